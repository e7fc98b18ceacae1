"""A Katz-backoff n-gram language model over token ids: a drafter with no neural net.

Proposing a token costs a couple of dict lookups (about a microsecond), so an
n-gram stage can sit below a small transformer draft and still pay for itself
whenever its guesses are accepted.  The model is exact (every conditional
distribution sums to 1) so that its probabilities can also serve as draft
scores; the fast paths (`top_k`, `propose_chain`) read precomputed tables that
agree with `distribution`.

Formulas
--------
Order n (2..5).  An m-gram (1 <= m <= n) is a context h of m-1 tokens followed
by a token w; n-grams never span two training documents.  c(h w) is its count,
c(h) = sum_w c(h w) counts the occurrences of h that have a next token, S(h) is
the set of w with c(h w) > 0, and h' is h without its oldest token.

Unigram (add-one over the whole vocabulary of size V, N training tokens), so
every token keeps some probability:

    P(w) = (c(w) + 1) / (N + V)

Discounted counts, for each order m >= 2 separately, from its counts of counts
n_r (how many distinct m-grams were seen exactly r times) and k = 5:

    c*(h w) = d_r * r   if 1 <= r <= k,        c*(h w) = r   if r > k

    Good-Turing (Katz):  r* = (r + 1) n_{r+1} / n_r,   A = (k + 1) n_{k+1} / n_1,
                         d_r = (r* / r - A) / (1 - A)

The Good-Turing estimates are degenerate when some n_r (1 <= r <= k + 1) is 0,
A >= 1, or some d_r lies outside (0, 1] (typical of small corpora).  Then
absolute discounting replaces them:

    c*(h w) = r - D  for 1 <= r <= k,   D = n_1 / (n_1 + 2 n_2)   (D = 1/2 if n_1 or n_2 is 0)

Backoff, for a context h of m - 1 >= 1 tokens:

    P*(w | h) = c*(h w) / c(h)                               for w in S(h)
    P(w | h)  = P*(w | h)                    if w in S(h)
              = alpha(h) * P(w | h')         otherwise
    alpha(h)  = (1 - sum_{w in S(h)} P*(w | h)) / (1 - sum_{w in S(h)} P(w | h'))

An unseen context (c(h) = 0) backs off entirely: P(w | h) = P(w | h').  If h w
was seen then so was h' w, so the denominator only needs P*(w | h') (or the
unigram when h' is empty).  Two edge cases keep the sums exact: a denominator
of 0 (S(h) already holds all of P(. | h')'s mass) leaves the freed mass nowhere
to go, so P*(. | h) is renormalised to sum to 1 and alpha(h) = 0; a numerator
of 0 (no count of h was discounted) gives alpha(h) = 0.  By induction on the
order, sum_w P(w | h) = 1 for every context.

Ranking and fast tables
-----------------------
Tokens are ranked by probability, ties by smaller id.  For each seen context
the build stores its `top_n` (default 8) best tokens under the *full* backoff
distribution (seen continuations and backed-off mass together).  They are
found without a V-sized vector per context: the best tokens of h are among
its best seen continuations and the best tokens of h' (kept to a longer
internal length), and an upper bound on everything not listed tells when the
merge is provably exact; the rare context where it is not gets its dense
distribution sorted instead.  A lookup grows the query's suffix one older
token at a time through one dict per order (key of h = row of h' one order
down, times V, plus h[0]) and stops at the first unseen one: if h is unseen
so is every longer context ending in h.  The longest seen suffix's table row
is exact because an unseen context's distribution *is* its suffix's.

File format
-----------
One numpy `.npz` archive (zip, deflate-compressed, no pickles).  `meta` holds a
JSON string: format "stagedspec-ngram", version, order, vocab_size,
fingerprint (the caller's tokenizer fingerprint, e.g. `tokenizer.vocab_fingerprint`),
top_n, discount_k, per-order discounts, n_tokens, n_documents.  Arrays:
`unigram` (float64 [V]), `unigram_top_tok`/`unigram_top_prob` ([1, top_n]),
and for each order m in 2..n, with C seen contexts and E seen m-grams:
`o{m}_keys` (int64 [C], the lookup keys), `o{m}_lower` (int32 [C], row of h'
at order m - 1), `o{m}_alpha` (float64 [C]), `o{m}_offsets` (int64 [C + 1]),
`o{m}_tokens` (int32 [E], ascending within a context), `o{m}_pstar`
(float64 [E]), `o{m}_top_tok` (int32 [C, top_n], -1 padded) and
`o{m}_top_prob` (float32 [C, top_n], 0 padded).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from stagedspec.errors import StagedSpecError

FORMAT = "stagedspec-ngram"
FORMAT_VERSION = 1
DEFAULT_ORDER = 3
MIN_ORDER, MAX_ORDER = 2, 5
DEFAULT_TOP_N = 8
DEFAULT_DISCOUNT_K = 5
_CHUNK_ROWS = 1 << 16  # contexts merged per vectorised step while building tables


# --------------------------------------------------------------------------- discounting


@dataclass(frozen=True)
class Discount:
    """How one order's counts are discounted: `factors[r]` = d_r for 1 <= r <= k."""

    method: str  # "good-turing" or "absolute"
    k: int
    factors: tuple[float, ...]  # index 0 unused; d_r for r = 1..k (absolute: (r - D) / r)
    absolute_d: float = 0.0

    def apply(self, counts: np.ndarray) -> np.ndarray:
        """Discounted counts c* (float64) for raw counts >= 1."""
        counts = np.asarray(counts, dtype=np.float64)
        table = np.ones(self.k + 1)
        table[1:] = self.factors[1:]
        r = counts.astype(np.int64)
        return np.where(r <= self.k, counts * table[np.minimum(r, self.k)], counts)

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "factors": list(self.factors[1:]), "D": self.absolute_d}


def katz_discount(count_of_counts: Mapping[int, int], k: int = DEFAULT_DISCOUNT_K) -> Discount:
    """Good-Turing discount ratios d_1..d_k, or absolute discounting where GT is degenerate."""
    if k < 1:
        raise StagedSpecError(f"discount k must be >= 1, got {k}")
    n = [int(count_of_counts.get(r, 0)) for r in range(k + 2)]
    factors = _good_turing_factors(n, k)
    if factors is not None:
        return Discount("good-turing", k, (1.0, *factors))
    d = n[1] / (n[1] + 2 * n[2]) if n[1] > 0 and n[2] > 0 else 0.5
    return Discount("absolute", k, (1.0, *((r - d) / r for r in range(1, k + 1))), d)


def _good_turing_factors(n: list[int], k: int) -> list[float] | None:
    if any(n[r] == 0 for r in range(1, k + 2)):
        return None
    a = (k + 1) * n[k + 1] / n[1]
    if a >= 1:
        return None
    factors = []
    for r in range(1, k + 1):
        r_star = (r + 1) * n[r + 1] / n[r]
        d = (r_star / r - a) / (1 - a)
        if not 0 < d <= 1:
            return None
        factors.append(d)
    return factors


# --------------------------------------------------------------------------- model


@dataclass
class _Level:
    """Tables for one order m >= 2; row r is one seen context h of m - 1 tokens."""

    keys: np.ndarray  # int64 [C]: lower[r] * V + h[0] (h's oldest token)
    lower: np.ndarray  # int32 [C]: row of h' at order m - 1 (the unigram's row 0 when m = 2)
    alpha: np.ndarray  # float64 [C]
    offsets: np.ndarray  # int64 [C + 1]: row r's continuations are tokens[offsets[r]:offsets[r + 1]]
    tokens: np.ndarray  # int32 [E], ascending within a row
    pstar: np.ndarray  # float64 [E]: P*(w | h)
    top_tok: np.ndarray  # int32 [C, top_n], -1 padded
    top_prob: np.ndarray  # float32 [C, top_n], 0 padded

    @property
    def n_contexts(self) -> int:
        return len(self.keys)


class NgramModel:
    """A trained Katz-backoff model; build with `build_from_token_streams`, or `load`."""

    def __init__(
        self,
        order: int,
        vocab_size: int,
        fingerprint: str,
        unigram: np.ndarray,
        unigram_top: tuple[np.ndarray, np.ndarray],
        levels: dict[int, _Level],
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.order = order
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.unigram = unigram
        self.levels = levels
        self.meta = dict(meta or {})
        self.top_n = unigram_top[0].shape[1]
        # Per order m (index m), the table rows; order 1 is the unigram's single row.
        self._top_tok = [None, unigram_top[0]] + [levels[m].top_tok for m in range(2, order + 1)]
        self._top_prob = [None, unigram_top[1]] + [levels[m].top_prob for m in range(2, order + 1)]
        self._index: list[dict[int, int] | None] = [None, None] + [
            dict(zip(levels[m].keys.tolist(), range(levels[m].n_contexts))) for m in range(2, order + 1)
        ]

    # ------------------------------------------------------------------ queries

    def _locate(self, tail: list[int]) -> tuple[int, int]:
        """(order, row) of the longest suffix of `tail` that is a seen context; (1, 0) if none.

        `tail` must hold at most order - 1 tokens.
        """
        V, index = self.vocab_size, self._index
        row, m = 0, 1
        for t in reversed(tail):
            if not 0 <= t < V:
                break
            nxt = index[m + 1].get(row * V + t)
            if nxt is None:
                break
            row, m = nxt, m + 1
        return m, row

    def _tail(self, context_ids: Sequence[int]) -> list[int]:
        """The last order - 1 context tokens as Python ints (older ones cannot matter)."""
        keep = self.order - 1
        tail = context_ids[-keep:] if len(context_ids) > keep else context_ids
        return tail.tolist() if isinstance(tail, np.ndarray) else [int(t) for t in tail]

    def _dense(self, m: int, row: int) -> np.ndarray:
        return _dense_distribution(self.unigram, self.levels, m, row)

    def distribution(self, context_ids: Sequence[int]) -> np.ndarray:
        """P(. | context) as a float64 vector over the vocabulary; sums to 1."""
        return self._dense(*self._locate(self._tail(context_ids)))

    def prob(self, context_ids: Sequence[int], token: int) -> float:
        """P(token | context) without building the whole distribution."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            raise StagedSpecError(f"token id {token} is outside the vocabulary (size {self.vocab_size})")
        m, row = self._locate(self._tail(context_ids))
        alphas = []
        while m >= 2:
            lvl = self.levels[m]
            s, e = lvl.offsets[row], lvl.offsets[row + 1]
            i = s + int(np.searchsorted(lvl.tokens[s:e], token))
            if i < e and lvl.tokens[i] == token:
                p = float(lvl.pstar[i])
                break
            alphas.append(lvl.alpha[row])
            row, m = int(lvl.lower[row]), m - 1
        else:
            p = float(self.unigram[token])
        for a in reversed(alphas):  # same multiplication order as `distribution`
            p = float(a * p)
        return p

    def backoff_weight(self, context_ids: Sequence[int]) -> float:
        """alpha(h) for h = the last min(len, order - 1) context tokens; 1.0 if h was never seen."""
        tail = self._tail(context_ids)
        m, row = self._locate(tail)
        return float(self.levels[m].alpha[row]) if tail and m - 1 == len(tail) else 1.0

    def top_k(self, context_ids: Sequence[int], k: int) -> list[tuple[int, float]]:
        """The k most likely next tokens with their probabilities, best first.

        Up to `top_n` this is a table read; beyond it the dense distribution is
        sorted.  Tokens of probability 0 are never returned.
        """
        if k <= 0:
            return []
        m, row = self._locate(self._tail(context_ids))
        if k <= self.top_n:
            toks = self._top_tok[m][row, :k].tolist()
            probs = self._top_prob[m][row, :k].tolist()
            return [(t, p) for t, p in zip(toks, probs) if t >= 0]
        toks, probs = _top_of_dense(self._dense(m, row), k)
        return list(zip(toks.tolist(), probs.tolist()))

    def propose_chain(self, context_ids: Sequence[int], n: int) -> list[tuple[int, float]]:
        """Greedy continuation: n times, append the most likely token.  Probabilities are P(t | context so far)."""
        tail = self._tail(context_ids)
        keep = self.order - 1
        out: list[tuple[int, float]] = []
        top_tok, top_prob = self._top_tok, self._top_prob
        for _ in range(n):
            m, row = self._locate(tail[-keep:])  # keep >= 1 since order >= 2
            t = top_tok[m].item(row, 0)
            if t < 0:
                break
            out.append((t, top_prob[m].item(row, 0)))
            tail.append(t)
        return out

    # ------------------------------------------------------------------ info

    @property
    def n_contexts(self) -> dict[int, int]:
        """Seen contexts per order."""
        return {m: lvl.n_contexts for m, lvl in self.levels.items()}

    def summary(self) -> str:
        ctx = ", ".join(f"order {m}: {c:,}" for m, c in self.n_contexts.items())
        return f"{self.order}-gram model, vocab {self.vocab_size:,}, contexts ({ctx})"

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | Path) -> None:
        """Write the model to one `.npz` file (atomically: a temporary file, then a rename)."""
        path = Path(path)
        meta = {
            **self.meta,
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "order": self.order,
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "top_n": self.top_n,
        }
        arrays: dict[str, np.ndarray] = {
            "meta": np.array(json.dumps(meta)),
            "unigram": self.unigram,
            "unigram_top_tok": self._top_tok[1],
            "unigram_top_prob": self._top_prob[1],
        }
        for m, lvl in self.levels.items():
            for name in ("keys", "lower", "alpha", "offsets", "tokens", "pstar", "top_tok", "top_prob"):
                arrays[f"o{m}_{name}"] = getattr(lvl, name)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **arrays)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StagedSpecError(f"cannot write n-gram file {path}: {e.strerror or e}") from e

    @classmethod
    def load(
        cls, path: str | Path, expected_fingerprint: str | None = None, expected_vocab_size: int | None = None
    ) -> "NgramModel":
        """Read a file written by `save`, checking it matches the caller's tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise StagedSpecError(f"n-gram file not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"][()]))
                if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                    raise ValueError("not a stagedspec n-gram file")
                if meta.get("version") != FORMAT_VERSION:
                    raise ValueError(f"unsupported format version {meta.get('version')!r}")
                order, vocab = int(meta["order"]), int(meta["vocab_size"])
                unigram = data["unigram"].astype(np.float64)
                uni_top = (data["unigram_top_tok"].astype(np.int32), data["unigram_top_prob"].astype(np.float32))
                levels = {
                    m: _Level(
                        keys=data[f"o{m}_keys"].astype(np.int64),
                        lower=data[f"o{m}_lower"].astype(np.int32),
                        alpha=data[f"o{m}_alpha"].astype(np.float64),
                        offsets=data[f"o{m}_offsets"].astype(np.int64),
                        tokens=data[f"o{m}_tokens"].astype(np.int32),
                        pstar=data[f"o{m}_pstar"].astype(np.float64),
                        top_tok=data[f"o{m}_top_tok"].astype(np.int32),
                        top_prob=data[f"o{m}_top_prob"].astype(np.float32),
                    )
                    for m in range(2, order + 1)
                }
            _check_tables(order, vocab, unigram, uni_top, levels)
        except StagedSpecError:
            raise
        except Exception as e:  # zip, npy, JSON and shape errors all mean the same thing to the user
            raise StagedSpecError(f"{path} is not a valid n-gram file ({type(e).__name__}: {e})") from e
        fingerprint = str(meta.get("fingerprint", ""))
        if expected_fingerprint is not None and fingerprint != expected_fingerprint:
            raise StagedSpecError(
                f"n-gram file was built for another tokenizer: {path} has fingerprint "
                f"{fingerprint[:16] or '(none)'}, this tokenizer has {expected_fingerprint[:16]}"
            )
        if expected_vocab_size is not None and vocab != expected_vocab_size:
            raise StagedSpecError(
                f"n-gram file {path} has vocabulary size {vocab}, the tokenizer has {expected_vocab_size}"
            )
        return cls(order, vocab, fingerprint, unigram, uni_top, levels, meta)


def _check_tables(
    order: int, vocab: int, unigram: np.ndarray, uni_top: tuple[np.ndarray, np.ndarray], levels: dict[int, _Level]
) -> None:
    """Reject inconsistent tables up front, so a damaged file never fails mid-generation."""
    if not MIN_ORDER <= order <= MAX_ORDER or vocab < 1:
        raise ValueError(f"bad header (order {order}, vocab {vocab})")
    if unigram.shape != (vocab,) or uni_top[0].ndim != 2 or uni_top[0].shape[0] != 1:
        raise ValueError("unigram table has the wrong shape")
    top_n = uni_top[0].shape[1]
    prev_rows = 1
    for m, lvl in levels.items():
        c, e = len(lvl.keys), len(lvl.tokens)
        if (
            lvl.lower.shape != (c,)
            or lvl.alpha.shape != (c,)
            or lvl.offsets.shape != (c + 1,)
            or lvl.pstar.shape != (e,)
            or lvl.top_tok.shape != (c, top_n)
            or lvl.top_prob.shape != (c, top_n)
        ):
            raise ValueError(f"order-{m} tables have inconsistent shapes")
        if c and (lvl.offsets[0] != 0 or lvl.offsets[-1] != e or np.any(np.diff(lvl.offsets) < 0)):
            raise ValueError(f"order-{m} offsets are corrupt")
        if e and (lvl.tokens.min() < 0 or lvl.tokens.max() >= vocab):
            raise ValueError(f"order-{m} tokens are out of range")
        if c and (lvl.lower.min() < 0 or lvl.lower.max() >= prev_rows or lvl.top_tok.max() >= vocab):
            raise ValueError(f"order-{m} back-off rows are out of range")
        prev_rows = c


# --------------------------------------------------------------------------- building


def build_from_token_streams(
    streams: Iterable[Sequence[int]] | Sequence[int] | np.ndarray,
    order: int,
    vocab_size: int,
    fingerprint: str,
    progress: bool = True,
    *,
    top_n: int = DEFAULT_TOP_N,
    discount_k: int = DEFAULT_DISCOUNT_K,
) -> NgramModel:
    """Train a model on documents of token ids (one flat sequence counts as one document).

    `fingerprint` identifies the tokenizer (e.g. `tokenizer.vocab_fingerprint(tok.get_vocab())`);
    `load` checks it so a file is never used with ids from another vocabulary.
    """
    if not MIN_ORDER <= order <= MAX_ORDER:
        raise StagedSpecError(f"n-gram order must be between {MIN_ORDER} and {MAX_ORDER}, got {order}")
    if vocab_size < 1:
        raise StagedSpecError(f"vocabulary size must be >= 1, got {vocab_size}")
    if top_n < 1:
        raise StagedSpecError(f"top_n must be >= 1, got {top_n}")
    if discount_k < 1:
        raise StagedSpecError(f"discount k must be >= 1, got {discount_k}")
    docs = _documents(streams, progress)
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    if lengths.sum() == 0:
        raise StagedSpecError("no tokens to train the n-gram model on")
    tokens = np.concatenate(docs)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise StagedSpecError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    ends = np.repeat(np.cumsum(lengths), lengths)
    return _Builder(tokens, ends, order, vocab_size, fingerprint, top_n, discount_k, progress).build(len(docs))


def _documents(streams: Any, progress: bool) -> list[np.ndarray]:
    if getattr(streams, "ndim", None) == 1:  # a numpy array or tensor: one document
        streams = [streams]
    elif isinstance(streams, Sequence) and len(streams) and isinstance(streams[0], (int, np.integer)):
        streams = [streams]
    docs = []
    for doc in tqdm(streams, desc="n-gram: reading documents", unit="doc", disable=not progress):
        arr = np.asarray(doc, dtype=np.int64)
        if arr.ndim != 1:
            raise StagedSpecError(f"each document must be a flat sequence of token ids, got shape {arr.shape}")
        docs.append(arr)
    if not docs:
        raise StagedSpecError("no documents to train the n-gram model on")
    return docs


@dataclass
class _Grams:
    """Distinct m-grams in (prefix, token) order; entry ids are positions in these arrays."""

    prefix: np.ndarray  # entry id of the (m-1)-gram prefix (for m = 2: its token)
    token: np.ndarray
    count: np.ndarray
    suffix: np.ndarray  # entry id of the (m-1)-gram suffix, one order down
    first: np.ndarray  # the m-gram's oldest token


@dataclass
class _Lists:
    """Top lists of one order while building: exact prefixes of each row's ranking."""

    tok: np.ndarray  # int32 [C, L], -1 padded
    prob: np.ndarray  # float64 [C, L], -1 padded
    bound: np.ndarray  # float64 [C]: no unlisted token has a larger probability


class _Builder:
    def __init__(
        self,
        tokens: np.ndarray,
        ends: np.ndarray,
        order: int,
        vocab: int,
        fingerprint: str,
        top_n: int,
        discount_k: int,
        progress: bool,
    ) -> None:
        self.tokens, self.ends, self.order, self.V = tokens, ends, order, vocab
        self.fingerprint, self.top_n, self.k, self.progress = fingerprint, top_n, discount_k, progress
        self.list_len = 3 * top_n  # longer internal lists make exact merges likely one order up
        self.dense_fallbacks = 0

    def build(self, n_docs: int) -> NgramModel:
        V, order = self.V, self.order
        grams = self._count()
        unigram = (np.bincount(self.tokens, minlength=V) + 1.0) / (len(self.tokens) + V)
        lists = self._unigram_lists(unigram)
        uni_top = (lists.tok[:, : self.top_n].copy(), lists.prob[:, : self.top_n].clip(0).astype(np.float32))
        self.unigram = unigram
        self.levels: dict[int, _Level] = {}
        levels = self.levels
        discounts = {}
        p_prev = unigram  # P* of order m - 1, by entry id (the unigram, by token, for m = 2)
        ctxrow_prev = np.zeros(0, np.int64)  # order m - 2 entry id -> row at order m - 1
        bar = tqdm(range(2, order + 1), desc="n-gram: backoff tables", unit="order", disable=not self.progress)
        for m in bar:
            g = grams[m]
            lvl, ctxrow, discounts[m] = self._level(m, g, grams.get(m - 1), p_prev, ctxrow_prev)
            levels[m] = lvl  # `_dense` during the merge needs orders <= m
            lists = self._merge_lists(m, lvl, lists)
            lvl.top_tok = lists.tok[:, : self.top_n].copy()
            lvl.top_prob = lists.prob[:, : self.top_n].clip(0).astype(np.float32)
            p_prev, ctxrow_prev = lvl.pstar, ctxrow
        meta = {
            "discount_k": self.k,
            "discounts": {str(m): d.as_dict() for m, d in discounts.items()},
            "n_tokens": int(len(self.tokens)),
            "n_documents": int(n_docs),
            "dense_fallbacks": self.dense_fallbacks,
        }
        return NgramModel(order, V, self.fingerprint, unigram, uni_top, levels, meta)

    def _count(self) -> dict[int, _Grams]:
        """Distinct m-grams for m = 2..order with counts, prefix and suffix entry ids."""
        tokens, V = self.tokens, self.V
        pos = np.arange(len(tokens))
        entry_prev = tokens  # entry id of the (m-1)-gram starting at each position (order 1: the token)
        first_prev = np.arange(V)  # oldest token of each (m-1)-gram entry
        grams = {}
        bar = tqdm(range(2, self.order + 1), desc="n-gram: counting", unit="order", disable=not self.progress)
        for m in bar:
            starts = np.flatnonzero(pos + m <= self.ends)
            keys = entry_prev[starts] * V + tokens[starts + m - 1]
            uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
            suffix = np.empty(len(uniq), np.int64)
            suffix[inverse] = entry_prev[starts + 1]
            prefix = uniq // V
            grams[m] = _Grams(prefix, uniq % V, counts, suffix, first_prev[prefix])
            first_prev = grams[m].first
            entry = np.full(len(tokens), -1, np.int64)
            entry[starts] = inverse
            entry_prev = entry
        return grams

    def _level(
        self, m: int, g: _Grams, g_prev: _Grams | None, p_prev: np.ndarray, ctxrow_prev: np.ndarray
    ) -> tuple[_Level, np.ndarray, Discount]:
        """P*, alpha and lookup keys for order m (formulas in the module docstring)."""
        V, E = self.V, len(g.count)
        starts = np.flatnonzero(np.r_[True, g.prefix[1:] != g.prefix[:-1]])
        C = len(starts)
        offsets = np.r_[starts, E].astype(np.int64)
        row_of = np.repeat(np.arange(C), np.diff(offsets))
        ctx_entry = g.prefix[starts]  # each context h as an entry one order down
        ctxrow = np.full(V if m == 2 else len(g_prev.count), -1, np.int64)
        ctxrow[ctx_entry] = np.arange(C)

        values, freq = np.unique(g.count, return_counts=True)
        discount = katz_discount(dict(zip(values.tolist(), freq.tolist())), self.k)
        cstar = discount.apply(g.count)
        c_h = np.add.reduceat(g.count.astype(np.float64), starts)
        pstar = cstar / c_h[row_of]
        p_lower_seen = p_prev[g.suffix]  # P*(w | h') for each seen h w
        num = 1.0 - np.add.reduceat(pstar, starts)
        den = 1.0 - np.add.reduceat(p_lower_seen, starts)
        stuck = den <= 1e-12  # S(h) holds all of P(. | h')'s mass: renormalise instead
        if stuck.any():
            pstar = np.where(stuck[row_of], cstar / np.add.reduceat(cstar, starts)[row_of], pstar)
        alpha = np.zeros(C)
        ok = ~stuck & (num > 1e-15)
        alpha[ok] = num[ok] / den[ok]

        if m == 2:
            lower = np.zeros(C, np.int64)
            keys = ctx_entry.astype(np.int64)
        else:
            lower = ctxrow_prev[g_prev.suffix[ctx_entry]]
            assert lower.min() >= 0, "the suffix of a seen context is seen"
            keys = lower * V + g_prev.first[ctx_entry]
        lvl = _Level(
            keys=keys,
            lower=lower.astype(np.int32),
            alpha=alpha,
            offsets=offsets,
            tokens=g.token.astype(np.int32),
            pstar=pstar,
            top_tok=np.zeros((0, 0), np.int32),
            top_prob=np.zeros((0, 0), np.float32),
        )
        return lvl, ctxrow, discount

    def _unigram_lists(self, unigram: np.ndarray) -> _Lists:
        toks, probs = _top_of_dense(unigram, self.list_len + 1)
        return _pack_dense_top(toks, probs, self.list_len)

    def _merge_lists(self, m: int, lvl: _Level, below: _Lists) -> _Lists:
        """Top lists of order m from its seen continuations and the lists of order m - 1.

        Candidates per context: its best `L` seen continuations and the lower
        context's list (minus tokens seen here), scaled by alpha.  Every token
        missing from both has probability <= B = max(alpha * lower bound,
        (L+1)-th seen P*), so candidates ranked strictly above B are exact.
        Contexts with fewer than top_n exact candidates are sorted densely.
        """
        V, L, C = self.V, self.list_len, lvl.n_contexts
        E = len(lvl.tokens)
        row_of = np.repeat(np.arange(C), np.diff(lvl.offsets))
        ranked = np.lexsort((lvl.tokens, -lvl.pstar, row_of))  # by row, then rank within the row
        rank = np.arange(E) - lvl.offsets[row_of[ranked]]
        seen_tok = np.full((C, L), -1, np.int32)
        seen_prob = np.full((C, L), -1.0)
        keep = rank < L
        seen_tok[row_of[ranked[keep]], rank[keep]] = lvl.tokens[ranked[keep]]
        seen_prob[row_of[ranked[keep]], rank[keep]] = lvl.pstar[ranked[keep]]
        seen_bound = np.zeros(C)
        nxt = rank == L
        seen_bound[row_of[ranked[nxt]]] = lvl.pstar[ranked[nxt]]
        entry_keys = row_of * V + lvl.tokens  # ascending: rows ascending, tokens ascending within

        out = _Lists(np.full((C, L), -1, np.int32), np.full((C, L), -1.0), np.zeros(C))
        chunks = range(0, C, _CHUNK_ROWS)
        bar = tqdm(chunks, desc=f"n-gram: order-{m} top lists", unit="chunk", disable=not self.progress or C < 1e6)
        for lo in bar:
            rows = np.arange(lo, min(lo + _CHUNK_ROWS, C))
            low = lvl.lower[rows]
            alpha = lvl.alpha[rows]
            ltok, lprob = below.tok[low], below.prob[low]
            query = rows[:, None] * V + np.maximum(ltok, 0)
            at = np.minimum(np.searchsorted(entry_keys, query), max(E - 1, 0))
            drop = (ltok < 0) | (entry_keys[at] == query)  # padding, or seen here (already a seen candidate)
            cand_tok = np.concatenate([seen_tok[rows], np.where(drop, -1, ltok)], axis=1)
            cand_prob = np.concatenate([seen_prob[rows], np.where(drop, -1.0, alpha[:, None] * lprob)], axis=1)
            # Rank by (-prob, token): stable sorts, token first; padding (-1 prob) sorts last.
            by_tok = np.argsort(np.where(cand_tok < 0, V, cand_tok), axis=1, kind="stable")
            cand_tok = np.take_along_axis(cand_tok, by_tok, 1)
            cand_prob = np.take_along_axis(cand_prob, by_tok, 1)
            by_prob = np.argsort(-cand_prob, axis=1, kind="stable")
            cand_tok = np.take_along_axis(cand_tok, by_prob, 1)
            cand_prob = np.take_along_axis(cand_prob, by_prob, 1)
            bound = np.maximum(alpha * below.bound[low], seen_bound[rows])
            exact = (cand_prob > bound[:, None]).sum(1)
            cols = np.arange(L)
            listed = cols[None, :] < np.minimum(exact, L)[:, None]
            out.tok[rows] = np.where(listed, cand_tok[:, :L], -1)
            out.prob[rows] = np.where(listed, cand_prob[:, :L], -1.0)
            out.bound[rows] = np.where(exact > L, cand_prob[:, L], bound)
            for r in rows[(exact < self.top_n) & (bound > 0)].tolist():
                self.dense_fallbacks += 1
                toks, probs = _top_of_dense(self._dense(m, r), L + 1)
                packed = _pack_dense_top(toks, probs, L)
                out.tok[r], out.prob[r], out.bound[r] = packed.tok[0], packed.prob[0], packed.bound[0]
        return out

    def _dense(self, m: int, row: int) -> np.ndarray:
        return _dense_distribution(self.unigram, self.levels, m, row)


def _dense_distribution(unigram: np.ndarray, levels: dict[int, _Level], m: int, row: int) -> np.ndarray:
    """The full distribution of the context at (order m, row), float64 [V].

    Built bottom-up (unigram, then each order's alpha and P*), the same
    floating-point operations the build's merged top lists rely on.
    """
    rows = [0] * (m + 1)
    rows[m] = row
    for j in range(m, 2, -1):
        rows[j - 1] = int(levels[j].lower[rows[j]])
    dist = unigram.copy()
    for j in range(2, m + 1):
        lvl, r = levels[j], rows[j]
        dist *= lvl.alpha[r]
        s, e = lvl.offsets[r], lvl.offsets[r + 1]
        dist[lvl.tokens[s:e]] = lvl.pstar[s:e]
    return dist


def _top_of_dense(dist: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best positive entries of a dense distribution, ranked by (-prob, token)."""
    pos = np.flatnonzero(dist > 0)
    vals = dist[pos]
    if len(pos) > k:
        threshold = np.partition(vals, len(pos) - k)[len(pos) - k]
        keep = vals >= threshold  # all ties at the threshold, so the token order below decides them
        pos, vals = pos[keep], vals[keep]
    ranked = np.lexsort((pos, -vals))[:k]
    return pos[ranked], vals[ranked]


def _pack_dense_top(toks: np.ndarray, probs: np.ndarray, L: int) -> _Lists:
    """One exact row from a dense top-(L+1): the first L, bounded by the (L+1)-th (0 if none)."""
    tok = np.full((1, L), -1, np.int32)
    prob = np.full((1, L), -1.0)
    n = min(L, len(toks))
    tok[0, :n], prob[0, :n] = toks[:n], probs[:n]
    bound = float(probs[L]) if len(toks) > L else 0.0
    return _Lists(tok, prob, np.array([bound]))


# --------------------------------------------------------------------------- benchmarking


def benchmark_lookup(
    model: NgramModel, contexts: Sequence[Sequence[int]], chain_length: int = 1, repeats: int = 3
) -> float:
    """Microseconds per proposed token for greedy proposals from each context (best of `repeats`)."""
    prepared = [list(map(int, c)) for c in contexts]
    if not prepared or chain_length < 1:
        raise StagedSpecError("benchmark_lookup needs at least one context and chain_length >= 1")
    best = float("inf")
    for _ in range(max(1, repeats)):
        proposed = 0
        start = time.perf_counter()
        for ctx in prepared:
            proposed += len(model.propose_chain(ctx, chain_length))
        elapsed = time.perf_counter() - start
        best = min(best, elapsed / max(proposed, 1))
    return best * 1e6
