"""Sampling under a grammar mask and a logit bias keeps the *constrained* oracle distribution, exactly.

Enumerable toy models (V = 5 tokens, L = 3 new tokens, a fixed random table
of logits per context) and a toy grammar whose mask depends on the path (a
token may not follow itself or its predecessor mod V), plus a bias.  The
exact distribution over the V**3 continuations comes from an independent
numpy reference (bias, mask, temperature, top-k from their definitions);
samples come from the real loop with the real `ConstrainedOracle` and a
drafter whose rows go through the same `LogitsProcessor`.  Pearson's
chi-square test, cells with expected count < 5 pooled; a sample in a cell
of probability 0 fails outright.

With N = 3,000 samples per configuration a bias of total variation >= 8%
is caught with power > 0.9 for the worst-case shape (see
tests/test_distribution_exactness.py for the bound).  Two negative controls
show the test catching the mistakes the constraint machinery could make:
every row masked with the root's grammar state instead of its own path's,
and a sampled draft verified against the unmasked q instead of the masked q
its tokens were drawn from.
"""

from __future__ import annotations

import zlib
from collections import Counter
from itertools import product
from typing import Sequence

import numpy as np
import pytest
import torch
from torch import Tensor

from stagedspec.constraints import ConstrainedOracle, LogitsProcessor
from stagedspec.drafters.base import Drafter
from stagedspec.generation import speculative_generate
from stagedspec.sampling import SamplingParams, probs_from_logits
from stagedspec.tree import TokenTree, grow_tree

V, L = 5, 3
N = 3_000
ALPHA = 1e-3
BIAS = {3: 1.0, 4: -0.5}
PROMPT = (2,)

pytestmark = pytest.mark.usefixtures("one_thread")


class Rule:
    """Toy grammar state: the last token; the next may be neither it nor its successor mod V."""

    def __init__(self, last: int) -> None:
        self.last = last

    def banned(self) -> set[int]:
        return {self.last, (self.last + 1) % V}

    def allowed(self) -> Tensor:
        mask = torch.ones(V, dtype=torch.bool)
        mask[list(self.banned())] = False
        return mask

    def child(self, token: int) -> "Rule":
        return Rule(token)


START = Rule(0)


def table(salt: int, ctx: tuple[int, ...], scale: float = 1.5) -> Tensor:
    seed = zlib.crc32(bytes([salt, *ctx]))
    return scale * torch.randn(V, generator=torch.Generator().manual_seed(seed))


def path(tree: TokenTree, node: int) -> list[int]:
    return [tree.tokens[j] for j in tree.path_to(node)]


class ToyOracle:
    forward_passes = 0
    bit_exact = False

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.history = list(prompt_ids[:-1])

    def score(self, tree: TokenTree) -> Tensor:
        self.tree = tree
        base = self.history + [tree.tokens[0]]
        return torch.stack([table(0, tuple(base + path(tree, i))) for i in range(len(tree))])

    def commit(self, accepted: Sequence[int]) -> None:
        self.history += [self.tree.tokens[0], *(self.tree.tokens[i] for i in accepted)]


class ToyDrafter(Drafter):
    """`grow_tree` over a draft table, its rows through `processor` (as `ModelDrafter` does), plus an optional
    fixed chain (a lookup's: the draft's unconstrained argmax path, forbidden tokens and all)."""

    def __init__(self, processor: LogitsProcessor, tree_kw: dict, fixed_chain: bool = False,
                 stale_q: bool = False) -> None:
        self.processor, self.tree_kw, self.fixed_chain, self.stale_q = processor, tree_kw, fixed_chain, stale_q

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        ctx = list(context)
        raw: dict[tuple[int, ...], Tensor] = {}  # unmasked draft rows by path (the tree is re-indexed)

        def expand(tree: TokenTree, nodes: list[int]) -> Tensor:
            logits = torch.stack([table(77, tuple(ctx + path(tree, n))) for n in nodes])
            raw.update((tuple(path(tree, n)), row) for n, row in zip(nodes, logits))
            return self.processor.rows(ctx, tree, nodes, logits)

        tree = grow_tree(ctx[-1], expand, sampling=sampling, generator=generator, **self.tree_kw)
        if self.stale_q:  # the mistake: verify against the unmasked q, not the masked one the draws came from
            tree.child_q = {u: probs_from_logits(raw[tuple(path(tree, u))], sampling) for u in tree.child_q}
        if self.fixed_chain:
            extra, node, seq = TokenTree([ctx[-1]], [-1]), 0, list(ctx)
            for _ in range(L):
                tok = int(table(77, tuple(seq)).argmax())
                node, seq = extra.add(node, tok, "context"), seq + [tok]
            tree.merge_fixed(extra)
        return tree


class RootMaskProcessor(LogitsProcessor):
    """The mistake: every row of a tree masked with the root's state, not its own path's."""

    def rows(self, context, tree, nodes, logits):  # noqa: ANN001, ANN201
        root_only = TokenTree([tree.tokens[0]] * len(tree), [-1] + [0] * (len(tree) - 1))
        return super().rows(context, root_only, [0] * len(list(nodes)), logits)


def reference(logits: np.ndarray, state: Rule, temperature: float, top_k: int) -> np.ndarray:
    """Constrained next-token distribution from the definitions: bias, mask, temperature, top-k, softmax."""
    z = logits.astype(np.float64).copy()
    for t, b in BIAS.items():
        z[t] += b
    for t in state.banned():
        z[t] = -np.inf
    z = z / temperature
    if top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        z[z < kth] = -np.inf
    e = np.exp(z - z.max())
    return e / e.sum()


def exact(temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    dist = {}
    for seq in product(range(V), repeat=L):
        prob, state = 1.0, START
        for t in range(L):
            prob *= float(reference(table(0, PROMPT + seq[:t]).numpy(), state, temperature, top_k)[seq[t]])
            state = state.child(seq[t])
            if prob == 0.0:
                break
        dist[seq] = prob
    return dist


def chi_square_p(counts: Counter, dist: dict) -> float:
    n = sum(counts.values())
    if any(dist.get(c, 0.0) == 0.0 for c in counts):
        return 0.0
    cells = sorted(((n * p, counts.get(c, 0)) for c, p in dist.items() if p > 0), reverse=True)
    big, small = [c for c in cells if c[0] >= 5], [c for c in cells if c[0] < 5]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] < 5 and big:
            e, o = big.pop()
            pooled = (pooled[0] + e, pooled[1] + o)
        big.append(pooled)
    stat, df = sum((o - e) ** 2 / e for e, o in big), len(big) - 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def run(sampling: SamplingParams, tree_kw: dict, n: int = N, processor_cls: type = LogitsProcessor,
        **drafter_kw: bool) -> float:
    counts: Counter = Counter()
    for seed in range(n):
        oracle_proc = processor_cls(V, BIAS, START)
        # the drafter shares the request's processor unless the mistake is the oracle's own masking
        draft_proc = oracle_proc if processor_cls is LogitsProcessor else LogitsProcessor(V, BIAS, START)
        oracle = ConstrainedOracle(ToyOracle(), oracle_proc, settles=True)
        if draft_proc is not oracle_proc:
            draft_proc.begin(list(PROMPT))
        drafter = ToyDrafter(draft_proc, tree_kw, **drafter_kw)
        out = speculative_generate(oracle, drafter, list(PROMPT), max_new_tokens=L, sampling=sampling, seed=seed)
        counts[tuple(out.token_ids)] += 1
    return chi_square_p(counts, exact(sampling.temperature, sampling.top_k))


CONFIGS = {
    "topk-tree-T1": (SamplingParams(1.0), dict(mode="topk", tree_budget=6, max_depth=3, branching=2)),
    "sampled-tree-T0.8-topk3": (SamplingParams(0.8, top_k=3), dict(mode="sampled", branching=[2, 2, 1])),
    "sampled-chain-mixed-T1.3": (SamplingParams(1.3), dict(mode="sampled", branching=[1, 1, 1])),
    "ar-T1": (SamplingParams(1.0), dict(mode="topk", tree_budget=0)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_constrained_sampling_matches_the_constrained_oracle(name: str) -> None:
    sampling, tree_kw = CONFIGS[name]
    p = run(sampling, tree_kw, fixed_chain="mixed" in name)
    assert p > ALPHA, f"{name}: p = {p:.2e}"


def test_negative_control_root_mask_for_every_row_is_caught() -> None:
    sampling, tree_kw = CONFIGS["topk-tree-T1"]
    assert run(sampling, tree_kw, n=1_000, processor_cls=RootMaskProcessor) < ALPHA


def test_negative_control_unmasked_q_is_caught() -> None:
    # no top-k: the unmasked q must cover every drawn token, or verification refuses the tree outright
    assert run(SamplingParams(1.0), dict(mode="sampled", branching=[2, 2, 1]), n=1_000, stale_q=True) < ALPHA
