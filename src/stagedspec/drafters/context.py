"""Prompt lookup: draft by copying what followed an earlier occurrence of the current suffix.

Code edits, summaries and chat answers repeat long spans of their prompt (and
of their own output), which a model-free drafter can propose for free.  The
drafter keeps the prompt plus every committed token and an index from each
n-gram (min_ngram..max_ngram tokens) to where it occurred and what followed,
updated incrementally as tokens are committed, so a proposal costs a few dict
lookups instead of a scan of the history.

Proposals are made from the longest suffix of the history (max_ngram tokens
down to min_ngram) that occurred earlier *with a known next token*; the
current suffix itself never matches itself.

- `propose_chain(n)` copies the n tokens that followed the most recent such
  occurrence.  The copy may run past the end of the history into the tokens
  it has just proposed (as in LZ77), so a repeating pattern extends itself.
  Each token's probability is the fraction of the matched suffix's recent
  occurrences (at most `recent` of them) that continued the same way up to
  and including that token, given they agreed on the tokens before it.
- `top_k(k)` lists distinct next tokens: those seen after the longest matched
  suffix first (most frequent first, ties to the most recent), then new ones
  after shorter matched suffixes.  Each probability is the token's empirical
  frequency after the suffix that contributed it, so the list is a ranking
  with per-suffix frequencies and need not sum to 1.
"""

from __future__ import annotations

import heapq
from typing import Iterable

from stagedspec.errors import StagedSpecError


class _Occurrences:
    """Where one n-gram occurred (with a next token) and what followed it."""

    __slots__ = ("ends", "nexts", "total")

    def __init__(self) -> None:
        self.ends: list[int] = []  # index of the n-gram's last token, oldest first (recent ones kept)
        self.nexts: dict[int, list[int]] = {}  # next token -> [count, index of its latest occurrence]
        self.total = 0


class ContextDrafter:
    """Online prompt-lookup drafter over the prompt and all committed tokens."""

    def __init__(
        self, tokens: Iterable[int] = (), *, max_ngram: int = 3, min_ngram: int = 1, recent: int = 32
    ) -> None:
        if min_ngram < 1:
            raise StagedSpecError(f"prompt-lookup min n-gram must be >= 1, got {min_ngram}")
        if max_ngram < min_ngram:
            raise StagedSpecError(f"prompt-lookup max n-gram ({max_ngram}) must be >= min n-gram ({min_ngram})")
        if recent < 1:
            raise StagedSpecError(f"prompt-lookup recent-occurrence window must be >= 1, got {recent}")
        self.max_ngram, self.min_ngram, self.recent = max_ngram, min_ngram, recent
        self._history: list[int] = []
        self._index: dict[tuple[int, ...], _Occurrences] = {}
        self.update(tokens)

    # ------------------------------------------------------------------ state

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Forget everything and start over from `tokens` (e.g. a new prompt)."""
        self._history.clear()
        self._index.clear()
        self.update(tokens)

    def update(self, new_tokens: Iterable[int]) -> None:
        """Append committed tokens; each one becomes the known next token of the n-grams before it."""
        hist, index = self._history, self._index
        lo, hi, keep = self.min_ngram, self.max_ngram, self.recent
        for tok in new_tokens:
            tok = int(tok)
            i = len(hist)  # position of `tok`
            for n in range(lo, min(hi, i) + 1):
                key = tuple(hist[i - n : i])
                occ = index.get(key)
                if occ is None:
                    occ = index[key] = _Occurrences()
                occ.ends.append(i - 1)
                if len(occ.ends) > 2 * keep:  # amortised trim: only the recent ones are ever read
                    del occ.ends[:-keep]
                stat = occ.nexts.get(tok)
                if stat is None:
                    occ.nexts[tok] = [1, i]
                else:
                    stat[0] += 1
                    stat[1] = i
                occ.total += 1
            hist.append(tok)

    def truncate(self, length: int) -> None:
        """Forget the tokens past the first `length`, as if they had never been added.

        Why: a drafter below a model stage sees that stage's speculative
        tokens, and the next step's context often takes some of them back;
        undoing the last few tokens costs far less than `reset` re-indexing
        the whole prompt.  The index ends up exactly as `reset(first length
        tokens)` would build it.
        """
        hist, index = self._history, self._index
        lo, hi, keep = self.min_ngram, self.max_ngram, self.recent
        while len(hist) > max(0, length):
            i = len(hist) - 1  # position of the token to take back
            tok = hist.pop()
            for n in range(lo, min(hi, i) + 1):
                key = tuple(hist[i - n : i])
                occ = index[key]
                occ.ends.pop()  # the newest end is i - 1: trimming only ever drops old ones
                occ.total -= 1
                if occ.total == 0:
                    del index[key]
                    continue
                if len(occ.ends) < min(keep, occ.total):  # older ends were trimmed away: find them again
                    occ.ends = self._ends_before(key, i - 1)[-keep:]
                stat = occ.nexts[tok]
                stat[0] -= 1
                if stat[0] == 0:
                    del occ.nexts[tok]
                else:
                    stat[1] = self._latest_next(key, tok, occ.ends)

    def _ends_before(self, key: tuple[int, ...], before: int) -> list[int]:
        """Ends (index of the last token) of every occurrence of `key` that ends before `before`."""
        hist, n = self._history, len(key)
        return [e for e in range(n - 1, before) if tuple(hist[e - n + 1 : e + 1]) == key]

    def _latest_next(self, key: tuple[int, ...], tok: int, recent_ends: list[int]) -> int:
        """Where `tok` last followed `key`: among the recent ends first (never empty while `key` has
        occurrences), else further back in the history."""
        hist = self._history
        for e in reversed(recent_ends):
            if hist[e + 1] == tok:
                return e + 1
        for e in reversed(self._ends_before(key, recent_ends[0])):
            if hist[e + 1] == tok:
                return e + 1
        raise AssertionError(f"token {tok} never followed {key}")  # its count said it did

    def __len__(self) -> int:
        return len(self._history)

    @property
    def tokens(self) -> list[int]:
        """A copy of the history (prompt + committed tokens)."""
        return list(self._history)

    # ------------------------------------------------------------------ proposals

    def _matches(self) -> Iterable[tuple[int, _Occurrences]]:
        """(length, occurrences) for each suffix that occurred before, longest first."""
        hist = self._history
        for n in range(min(self.max_ngram, len(hist)), self.min_ngram - 1, -1):
            occ = self._index.get(tuple(hist[len(hist) - n :]))
            if occ is not None:
                yield n, occ

    def match_length(self) -> int:
        """Tokens of the longest suffix `propose_chain` copies after (0: none matches).  How often a copy is
        right depends on it far more than on the text's kind (`stagedspec.auto.arms.CONTEXT_SERIES`)."""
        match = next(iter(self._matches()), None)
        return 0 if match is None else match[0]

    def propose_chain(self, n: int) -> list[tuple[int, float]]:
        """Up to n (token, probability) pairs copied after the longest matched suffix; [] if none matches."""
        if n <= 0:
            return []
        match = next(iter(self._matches()), None)
        if match is None:
            return []
        hist, size = self._history, len(self._history)
        proposed: list[int] = []

        def at(x: int) -> int:  # the history extended by the proposal (copies may overlap it)
            return hist[x] if x < size else proposed[x - size]

        starts = [e + 1 for e in match[1].ends[-self.recent :]]  # where each recent continuation begins
        source = starts[-1]  # the most recent occurrence is copied
        out: list[tuple[int, float]] = []
        for j in range(n):
            tok = at(source + j)
            agreeing = [s for s in starts if at(s + j) == tok]
            out.append((tok, len(agreeing) / len(starts)))
            starts = agreeing
            proposed.append(tok)
        return out

    def top_k(self, k: int) -> list[tuple[int, float]]:
        """Up to k distinct next tokens, longest matched suffix first; [] if none matches."""
        out: list[tuple[int, float]] = []
        if k <= 0:
            return out
        chosen: set[int] = set()
        for _, occ in self._matches():
            # Most frequent first, ties to the most recent; only k + |chosen| can be needed.
            ranked = heapq.nlargest(k + len(chosen), occ.nexts.items(), key=lambda item: item[1])
            for tok, (count, _last) in ranked:
                if tok not in chosen:
                    chosen.add(tok)
                    out.append((tok, count / occ.total))
                    if len(out) == k:
                        return out
        return out
