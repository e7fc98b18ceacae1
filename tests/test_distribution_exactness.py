"""Speculative sampling must reproduce the oracle's distribution exactly.

Method.  The oracle and the drafts are tiny *enumerable* language models: a
vocabulary of V = 5 tokens and a fixed table of random logits per context
(drawn lazily from a seed and the context bytes, so every run sees the same
models).  For a prompt and L = 3 new tokens we compute the oracle's exact
distribution over the V**3 continuations (temperature / top-k / top-p applied
at every step by `tests/_reference_sampling.py`, a numpy implementation of
their definitions independent of the engine's), draw N continuations with
the real loop (`speculative_generate`, one seed per sample) and run a
chi-square goodness-of-fit test.  Cells with expected count < 5 are pooled; a
sample in a cell of probability 0 fails outright.

Sample size.  A bias d (a signed vector over cells, total variation
TV = sum|d| / 2) gives the chi-square statistic a non-centrality
lambda = N * sum(d_i**2 / p_i) >= N * (2 TV)**2 (Cauchy-Schwarz; equality for
the least detectable shape, a tilt d_i proportional to +-p_i).  These
configurations have 8-124 pooled cells; rejecting at alpha = 1e-3 with power
0.9 needs lambda ~ 30 (df 7) to ~ 95 (df 103), so the worst-case detectable TV
with N samples is about sqrt(95 / (4 N)), and 2% needs N ~ 50,000 per
configuration (~10 s each at 0.15-0.4 ms per sample): too slow for every run.
So:

- the default tests use N_FAST = 4,000 per configuration, which detects any
  bias of TV >= 7% with power > 0.9 (worst-case shape), and typical bugs much
  earlier; `test_power_of_the_test` checks both power claims on synthetic
  samples drawn at a given TV from every configuration's distribution;
- `test_exactness_high_power` (slow, `--run-slow`, ~3 min) reruns every
  configuration with N_SLOW = 50,000: any 2% TV bias is rejected with
  power >= 0.9;
- the negative controls show the test catching real mistakes at
  N_NEGATIVE = 2,000 samples.  Their biases, estimated from 20,000 samples
  (noise floor ~0.02): (a) 0.60, (b) 0.58, (c) 0.59, (d) 0.23, and (d) with a
  good draft 0.06-0.08; all give p < 1e-5, most p = 0 in double precision.
  (The stale-q mistake (c) is nearly harmless with a draft close to the
  oracle, TV ~1%, which only the high-power run could see.)

All seeds are fixed, so the test is deterministic: the correct verifier passes
(p > 1e-3) and each wrong verifier fails (p < 1e-3) every run.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Sequence

import pytest
import torch
from torch import Tensor

from _reference_sampling import reference_probs
from stagedspec.auto import Arm, AutoDrafter, AutoPolicy
from stagedspec.costs import CostProfile
from stagedspec.drafters.base import Drafter
from stagedspec.generation import NoDrafter, speculative_generate
from stagedspec.sampling import SamplingParams, inverse_cdf_rows, probs_from_logits
from stagedspec.server.pressure import cut_tree
from stagedspec.tree import TokenTree, grow_tree
from stagedspec.verification import (
    VerifyResult,
    residual,
    deterministic_node_rule,
    sampled_node_rule,
    _decide_children,
    verify,
    verify_greedy,
    verify_sampled,
    walk_tree,
)

V = 5  # vocabulary size
L = 3  # new tokens per sample
N_FAST = 4_000
N_SLOW = 50_000
N_NEGATIVE = 2_000
N_CONTROL = 10_000  # the negative control's own configuration, run exactly
TV_FAST = 0.07  # worst-case TV that N_FAST detects with power > 0.9 (see the module docstring)
ALPHA = 1e-3
Dist = dict[tuple[int, ...], float]  # probability of each continuation
LOGIT_SCALE = 1.5  # toy logits ~ N(0, 1.5^2): peaked enough for top-p to bite, flat enough for many cells


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


# --------------------------------------------------------------------------
# Enumerable toy language models
# --------------------------------------------------------------------------


class TableLM:
    """Next-token logits per context: a fixed random table, filled lazily and cached.

    `kind` shapes a draft relative to an oracle `TableLM`:
    "oracle"/"bad" = its own random table (a bad draft is unrelated to the oracle),
    "good" = the oracle's logits plus a little noise,
    "disjoint" = mass only on tokens outside the oracle's top-`top_k`.
    """

    def __init__(self, salt: int, kind: str = "oracle", oracle: "TableLM | None" = None, top_k: int = 0) -> None:
        self.salt, self.kind, self.oracle, self.top_k = salt % 256, kind, oracle, top_k
        self._table: dict[tuple[int, ...], Tensor] = {}

    def _noise(self, ctx: tuple[int, ...]) -> Tensor:
        seed = zlib.crc32(bytes([self.salt, *ctx]))
        return torch.randn(V, generator=torch.Generator().manual_seed(seed))

    def logits(self, ctx: tuple[int, ...]) -> Tensor:
        row = self._table.get(ctx)
        if row is None:
            noise = self._noise(ctx)
            if self.kind in ("oracle", "bad"):
                row = LOGIT_SCALE * noise
            elif self.kind == "good":
                row = self.oracle.logits(ctx) + 0.5 * noise
            elif self.kind == "disjoint":
                row = noise.clone()
                row[self.oracle.logits(ctx).topk(self.top_k).indices] -= 50.0
            else:
                raise ValueError(self.kind)
            self._table[ctx] = row
        return row


class ToyOracle:
    """The loop's oracle over a `TableLM`: rows are looked up by context + path."""

    forward_passes = 0
    bit_exact = False

    def __init__(self, lm: TableLM) -> None:
        self.lm = lm

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.history = list(prompt_ids[:-1])  # committed tokens before the first root

    def score(self, tree: TokenTree) -> Tensor:
        self.tree = tree
        base = self.history + [tree.tokens[0]]
        return torch.stack([self.lm.logits(tuple(base + _path_tokens(tree, i))) for i in range(len(tree))])

    def commit(self, accepted: Sequence[int]) -> None:
        self.history += [self.tree.tokens[0], *(self.tree.tokens[i] for i in accepted)]


class ToyDrafter(Drafter):
    """Proposes with `grow_tree` over a draft `TableLM` (one `expand` = one table lookup per node).

    `record_q` also stores the draft distribution of every expanded node in
    `child_q` of a deterministic tree (only the negative control (a) uses it).
    """

    def __init__(self, lm: TableLM, tree_kw: dict, record_q: bool = False) -> None:
        self.tree_kw = dict(tree_kw)
        self.fixed_chains = self.tree_kw.pop("fixed_chains", 0)  # deterministic paths merged in (mixed trees)
        self.cut = self.tree_kw.pop("cut", None)  # keep only the best nodes, as the adaptive budget does
        # the server's memory-pressure cap (`server.pressure.cut_tree`), moving with history: caps[len(context) % n]
        self.caps = self.tree_kw.pop("caps", None)
        self.lm, self.record_q = lm, record_q

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context, sampling, generator, max_tokens=None) -> TokenTree:  # noqa: ANN001
        ctx = list(context)
        seen: dict[int, Tensor] = {}

        def expand(tree: TokenTree, nodes: list[int]) -> Tensor:
            logits = torch.stack([self.lm.logits(tuple(ctx + _path_tokens(tree, n))) for n in nodes])
            if self.record_q:
                seen.update(zip(nodes, probs_from_logits(logits, sampling)))
            return logits

        tree = grow_tree(ctx[-1], expand, sampling=sampling, generator=generator, **self.tree_kw)
        if self.record_q:
            tree.child_q = seen
        if self.cut is not None:
            # like `AdaptiveBudget`: how many nodes to keep depends on the draft's scores only
            tree = tree.best_prefix(self.cut if sum(tree.scores[1:]) > 1.0 else 1)
        if self.fixed_chains:
            tree.merge_fixed(self._lookup_tree(ctx))
        if self.caps is not None:
            tree = cut_tree(tree, self.caps[len(ctx) % len(self.caps)])
        return tree

    def _lookup_tree(self, ctx: list[int]) -> TokenTree:
        """Deterministic chains like a prompt lookup's: the draft table's greedy path, then a fixed pattern.

        The greedy path often repeats a drawn child, so which fixed nodes get
        merged depends on the draws: the case the mixed-node rule must handle.
        """
        extra = TokenTree([ctx[-1]], [-1])
        node, path = 0, list(ctx)
        for _ in range(L):
            tok = int(self.lm.logits(tuple(path)).argmax())
            node = extra.add(node, tok, "context")
            path.append(tok)
        if self.fixed_chains > 1:
            node = 0
            for d in range(L):
                node = extra.add(node, (ctx[-1] * 3 + d + 1) % V, "ngram")
        return extra


def _path_tokens(tree: TokenTree, node: int) -> list[int]:
    return [tree.tokens[j] for j in tree.path_to(node)]


def exact_distribution(lm: TableLM, prompt: Sequence[int], sampling: SamplingParams) -> Dist:
    """P(x1..xL | prompt) for every continuation, by the chain rule over the table.

    Each step's distribution comes from `reference_probs` (numpy, from the definitions), not from the
    engine's `probs_from_logits`: a mistake in the engine's temperature/top-k/top-p would otherwise be on
    both sides of the chi-square test and cancel (tests/test_sampling_reference.py pins the two together).
    """
    dist = {}
    s = sampling
    for seq in product(range(V), repeat=L):
        prob = 1.0
        for t in range(L):
            prob *= float(reference_probs(lm.logits(tuple(prompt) + seq[:t]), s.temperature, s.top_k, s.top_p)[seq[t]])
            if prob == 0.0:
                break
        dist[seq] = prob
    return dist


# --------------------------------------------------------------------------
# The statistical test
# --------------------------------------------------------------------------


def chi_square_pvalue(counts: Counter, dist: Dist) -> tuple[float, int]:
    """(p-value, degrees of freedom) of Pearson's test of `counts` against `dist`.

    Cells with expected count < 5 are pooled into one; an observation in a
    cell of probability 0 returns p = 0.
    """
    n = sum(counts.values())
    if any(dist.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0, 0
    cells = sorted(((n * p, counts.get(cell, 0)) for cell, p in dist.items() if p > 0), reverse=True)
    big = [c for c in cells if c[0] >= 5]
    small = [c for c in cells if c[0] < 5]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] < 5 and big:  # too small on its own: merge with the smallest big cell
            e, o = big.pop()
            pooled = (pooled[0] + e, pooled[1] + o)
        big.append(pooled)
    stat = sum((o - e) ** 2 / e for e, o in big)
    df = len(big) - 1
    return chi2_sf(stat, df), df


def chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(stat / 2, dtype=torch.float64)))


# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    sampling: SamplingParams
    draft: str  # "good" | "bad" | "disjoint"
    tree_kw: dict = field(hash=False)
    seed: int = 0  # picks the oracle and draft tables
    prompt: tuple[int, ...] = (2,)

    def models(self, record_q: bool = False) -> tuple[ToyOracle, ToyDrafter, dict]:
        oracle_lm = TableLM(salt=self.seed)
        draft_lm = TableLM(salt=self.seed + 128, kind=self.draft, oracle=oracle_lm, top_k=self.sampling.top_k)
        dist = exact_distribution(oracle_lm, self.prompt, self.sampling)
        return ToyOracle(oracle_lm), ToyDrafter(draft_lm, self.tree_kw, record_q), dist


def S(temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


CONFIGS = [
    # Deterministic (top-k, best-first) trees.
    Config("topk-bushy-T0.7-good", S(0.7), "good", dict(mode="topk", tree_budget=8, max_depth=4, branching=3), seed=1),
    Config("topk-bestfirst-w1-T1-topp0.8-bad", S(1.0, top_p=0.8), "bad",
           dict(mode="topk", tree_budget=5, branching=2, width=1), seed=2),
    Config("topk-disjoint-T1-topk2", S(1.0, top_k=2), "disjoint", dict(mode="topk", tree_budget=4, branching=2), seed=3),
    Config("chain-topk-3-T1.5-topk4-bad", S(1.5, top_k=4), "bad", dict(mode="topk", tree_budget=3, branching=1), seed=4),
    # Sampled (without replacement) trees.
    Config("sampled-321-T1-bad", S(1.0), "bad", dict(mode="sampled", branching=[3, 2, 1]), seed=5),
    Config("sampled-222-budget6-T1.5-good", S(1.5), "good",
           dict(mode="sampled", branching=[2, 2, 2], tree_budget=6), seed=6),
    Config("sampled-disjoint-T1-topk2", S(1.0, top_k=2), "disjoint", dict(mode="sampled", branching=[2, 1]), seed=7),
    Config("sampled-wide-T1-topk4-topp0.85", S(1.0, top_k=4, top_p=0.85), "good",
           dict(mode="sampled", branching=[4, 1]), seed=8),
    Config("chain-sampled-111-T0.7-topp0.9-bad", S(0.7, top_p=0.9), "bad",
           dict(mode="sampled", branching=[1, 1, 1]), seed=9),
    # Mixed trees: deterministic (lookup-like) chains merged into sampled and top-k trees.
    Config("mixed-sampled-21-fixed2-T1-bad", S(1.0), "bad", dict(mode="sampled", branching=[2, 1], fixed_chains=2),
           seed=11),
    Config("mixed-sampled-chain-fixed1-T0.7-topk3-good", S(0.7, top_k=3), "good",
           dict(mode="sampled", branching=[1, 1, 1], fixed_chains=1), seed=12),
    Config("mixed-topk-fixed2-T1-topp0.9-bad", S(1.0, top_p=0.9), "bad",
           dict(mode="topk", tree_budget=4, branching=2, fixed_chains=2), seed=13),
    # Best-first trees cut to their best nodes by a draft-only rule (the adaptive budget).
    Config("topk-cut-T1-good", S(1.0), "good", dict(mode="topk", tree_budget=8, branching=3, max_depth=3, cut=3), seed=14),
    # Trees cut to a node cap that moves with history (the server under memory pressure): sampled trees and
    # mixed ones keep their first nodes in index order (pre-order: earlier siblings' subtrees decide the cut).
    Config("sampled-321-capped-T1-bad", S(1.0), "bad", dict(mode="sampled", branching=[3, 2, 1], caps=(2, 4, 1, 3)),
           seed=15),
    Config("mixed-sampled-22-fixed2-capped-T1-topk4-good", S(1.0, top_k=4), "good",
           dict(mode="sampled", branching=[2, 2], fixed_chains=2, caps=(3, 5, 2)), seed=16),
    # The autoregressive baseline (root-only trees) through the same loop.
    Config("autoregressive-T1-topk3", S(1.0, top_k=3), "good", dict(mode="topk", tree_budget=0), seed=10),
]


def run_config(config: Config, n: int, verifier: Callable = verify, record_q: bool = False) -> tuple[float, int]:
    oracle, drafter, dist = config.models(record_q)
    counts: Counter = Counter()
    for seed in range(n):
        out = speculative_generate(
            oracle, drafter, list(config.prompt), max_new_tokens=L, sampling=config.sampling, seed=seed,
            verifier=verifier,
        )
        counts[tuple(out.token_ids)] += 1
    return chi_square_pvalue(counts, dist)


# --------------------------------------------------------------------------
# Wrong verifiers (negative controls): each must be caught by the same test
# --------------------------------------------------------------------------


def _with_rule(rule: Callable) -> Callable[..., VerifyResult]:
    return lambda tree, logits, sampling, generator: walk_tree(tree, logits, sampling, generator, rule)


Gen = torch.Generator | None


def topk_tree_as_if_sampled(tree: TokenTree, logits: Tensor, sampling: SamplingParams, generator: Gen) -> VerifyResult:
    """(a) A deterministic top-k tree verified with min(1, p/q), as if its children were draws from q."""
    return verify(dataclasses.replace(tree, sampled=True), logits, sampling, generator)


def best_branch_rule(p: Tensor, tokens: list[int], q: Tensor, generator: Gen) -> tuple[int | None, Tensor]:
    """(b) Try only the most promising child (largest p/q), as if it were the single draft."""
    q = q.double() / q.double().sum()
    ratios = [float(p[x] / q[x]) for x in tokens]
    best = max(range(len(tokens)), key=ratios.__getitem__)
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, ratios[best]):
        return best, p
    return None, residual(p, q)


def stale_q_rule(p: Tensor, tokens: list[int], q: Tensor, generator: Gen) -> tuple[int | None, Tensor]:
    """(c) Siblings drawn without replacement, but q is never updated after a rejection."""
    q = q.double() / q.double().sum()
    for i, x in enumerate(tokens):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, float(p[x] / q[x])):
            return i, p
        p = residual(p, q)
    return None, p


def no_residual_rule(p: Tensor, tokens: list[int], q: Tensor | None, generator: Gen) -> tuple[int | None, Tensor]:
    """(d) The right acceptance test, but the next token comes from p instead of the residual."""
    rule = sampled_node_rule if q is not None else deterministic_node_rule
    return rule(p, tokens, q, generator)[0], p


def fixed_first_verifier(tree: TokenTree, logits: Tensor, sampling: SamplingParams, generator: Gen) -> VerifyResult:
    """(e) A mixed node verified with its fixed children *before* its drawn ones.

    Then the target of the sampled rule depends on the draws (a fixed token
    is merged only when no drawn sibling has it), which biases the output.
    """
    kids = tree.children_lists()
    node, accepted = 0, []
    while True:
        p = probs_from_logits(logits[node], sampling).double()
        fixed = [c for c in kids[node] if c in tree.fixed]
        drawn = [c for c in kids[node] if c not in tree.fixed]
        choice, p = deterministic_node_rule(p, [tree.tokens[c] for c in fixed], None, generator) if fixed else (None, p)
        if choice is not None:
            node = fixed[choice]
        elif drawn:
            choice, p = sampled_node_rule(p, [tree.tokens[c] for c in drawn], tree.child_q[node], generator)
            node = drawn[choice] if choice is not None else node
        if choice is None:
            return VerifyResult(accepted, int(torch.multinomial(p, 1, generator=generator)))
        accepted.append(node)


NEGATIVE_CONTROLS = [  # (name, verifier, record draft q in top-k trees, configuration where the bias is large)
    ("a-topk-tree-as-sampled", topk_tree_as_if_sampled, True,
     Config("neg-a", S(1.0), "bad", dict(mode="topk", tree_budget=6, branching=2, max_depth=3), seed=21)),
    ("b-best-branch", _with_rule(best_branch_rule), False,
     Config("neg-b", S(1.0), "bad", dict(mode="sampled", branching=[4, 2]), seed=22)),
    ("c-stale-q", _with_rule(stale_q_rule), False,
     Config("neg-c", S(0.7), "bad", dict(mode="sampled", branching=[3, 3]), seed=23)),
    ("d-no-residual", _with_rule(no_residual_rule), False,
     Config("neg-d", S(1.0), "bad", dict(mode="sampled", branching=[1, 1, 1]), seed=24)),
    ("d-no-residual-good-draft", _with_rule(no_residual_rule), False,  # a subtler bias, TV ~ 7%
     Config("neg-d-good", S(1.0), "good", dict(mode="sampled", branching=[1, 1, 1]), seed=35)),
    ("e-fixed-before-drawn", fixed_first_verifier, False,
     Config("neg-e", S(1.0), "good", dict(mode="sampled", branching=[1, 1, 1], fixed_chains=1), seed=36)),
]


# --------------------------------------------------------------------------
# History-dependent shapes (`--method auto`) and a shape that peeks at the oracle
# --------------------------------------------------------------------------

# A synthetic cost curve on which the arm chosen after one step depends on that step's outcome.
TOY_PROFILE = CostProfile(oracle={1: 1.0, 2: 1.45, 4: 1.9, 8: 3.1, 16: 5.5}, drafts=[{1: 0.001, 8: 0.002}])


class FreshAutoDrafter(AutoDrafter):
    """The real `AutoDrafter` whose `AutoPolicy` starts from its priors at every sample.

    With the priors and `TOY_PROFILE`, the first step verifies a one-node
    tree; a rejection then makes plain decoding look fastest, an acceptance
    a four-node tree.  So within one sequence each step's shape depends on
    the oracle's earlier draws: the history dependence the exactness rule
    allows, at its sharpest.
    """

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.policy = AutoPolicy(self.policy.arms, TOY_PROFILE)
        self.all_choices = getattr(self, "all_choices", Counter())
        super().begin(prompt_ids)

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        tree = super().propose(context, sampling, generator, max_tokens)
        self.all_choices[self._last.arm.name] += 1
        return tree


def toy_auto_drafter(draft_lm: TableLM, sampled: bool) -> AutoDrafter:
    """Plain decoding and toy draft trees of three sizes, chosen per step by the real policy."""
    shapes = {Arm("tree", 1): [1], Arm("tree", 4): [2, 1], Arm("tree", 10): [2, 2, 1]}
    arms: dict = {Arm("ar"): (NoDrafter(), [])}
    for arm, branching in shapes.items():
        if sampled:
            kw = dict(mode="sampled", branching=branching)
        else:
            kw = dict(mode="topk", tree_budget=arm.size, branching=branching[0], max_depth=len(branching))
        arms[arm] = (ToyDrafter(draft_lm, kw), [])
    return FreshAutoDrafter(AutoPolicy(list(arms), TOY_PROFILE), arms)


class OraclePeekingDrafter(Drafter):
    """NEGATIVE CONTROL: proposes the draft's favourite token only when the oracle is about to accept it.

    It reads the current step's oracle distribution and the verifier's next
    uniform draw (a copy of the generator) — what a policy must never do —
    and so emits that token with probability p + (1 - p) p instead of p.
    """

    def __init__(self, oracle: ToyOracle, draft_lm: TableLM) -> None:
        self.oracle, self.draft_lm = oracle, draft_lm

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context, sampling, generator, max_tokens=None) -> TokenTree:  # noqa: ANN001
        ctx = tuple(context)
        x = int(self.draft_lm.logits(ctx).argmax())
        p = probs_from_logits(self.oracle.lm.logits(ctx), sampling).double()
        peek = torch.Generator().set_state(generator.get_state())
        u = float(torch.rand((), generator=peek, dtype=torch.float64))
        return TokenTree.chain(ctx[-1], [x]) if u < float(p[x]) else TokenTree([ctx[-1]], [-1])


def run_drafter(config: Config, drafter_for: Callable, n: int) -> tuple[float, int, object]:
    """Like `run_config`, with the drafter built by `drafter_for(oracle, draft_lm)`."""
    oracle_lm = TableLM(salt=config.seed)
    draft_lm = TableLM(salt=config.seed + 128, kind=config.draft, oracle=oracle_lm, top_k=config.sampling.top_k)
    oracle = ToyOracle(oracle_lm)
    drafter = drafter_for(oracle, draft_lm)
    counts: Counter = Counter()
    for seed in range(n):
        out = speculative_generate(oracle, drafter, list(config.prompt), max_new_tokens=L, sampling=config.sampling,
                                   seed=seed)
        counts[tuple(out.token_ids)] += 1
    return (*chi_square_pvalue(counts, exact_distribution(oracle_lm, config.prompt, config.sampling)), drafter)


AUTO_CONFIGS = [
    (Config("auto-sampled-T1-good", S(1.0), "good", {}, seed=41), True),
    (Config("auto-topk-T0.8-topp0.9-bad", S(0.8, top_p=0.9), "bad", {}, seed=42), False),
]


N_BATCHED_PATHS = 1_500  # `auto` through the batched rules: detects TV >= 0.09 (df 14-31, power 0.9); the rules
# themselves get N_FAST on every CONFIGS tree shape (`test_speculative_sampling_matches_the_oracle`)


@pytest.mark.parametrize("config, sampled, verifier",
                         [(*c, "walk") for c in AUTO_CONFIGS] + [(*c, "batched") for c in AUTO_CONFIGS],
                         ids=[f"{c[0].name}-{v}" for v in ("walk", "batched") for c in AUTO_CONFIGS])
def test_auto_history_dependent_shapes_keep_the_distribution(config: Config, sampled: bool, verifier: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    use_verifier(monkeypatch, verifier)
    n = N_FAST if verifier == "walk" else N_BATCHED_PATHS
    pvalue, df, drafter = run_drafter(config, lambda o, d: toy_auto_drafter(d, sampled), n)
    steps = sum(drafter.all_choices.values())
    used = [name for name, k in drafter.all_choices.items() if k >= 0.05 * steps]
    assert len(used) >= 2, f"the shape hardly changed: {drafter.all_choices}"
    assert pvalue > ALPHA, f"{config.name}: chi-square p = {pvalue:.3g} (df {df}) with {n} samples ({verifier})"


def test_auto_through_a_corrupted_batched_verifier_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched-path test above, with the batched leftover corrupted: 300 samples give p ~ 1e-17 here."""
    use_verifier(monkeypatch, "batched")
    corrupt_batched_leftover(monkeypatch)
    config, sampled = AUTO_CONFIGS[1]
    pvalue, _, _ = run_drafter(config, lambda o, d: toy_auto_drafter(d, sampled), 300)
    assert pvalue < ALPHA, f"a corrupted batched verifier passed under auto: p = {pvalue:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("config, sampled", AUTO_CONFIGS, ids=[c[0].name for c in AUTO_CONFIGS])
def test_auto_exactness_high_power(config: Config, sampled: bool) -> None:
    pvalue, df, _ = run_drafter(config, lambda o, d: toy_auto_drafter(d, sampled), N_SLOW)
    assert pvalue > ALPHA, f"{config.name}: chi-square p = {pvalue:.3g} (df {df}) with {N_SLOW} samples"


def test_a_shape_that_peeks_at_the_oracle_draw_is_caught() -> None:
    config = Config("neg-peek", S(1.0), "good", {}, seed=43)
    wrong, _, _ = run_drafter(config, OraclePeekingDrafter, N_NEGATIVE)
    # The control is a real test of the policy, so it gets the power of one: 2,000 samples failed it once
    # by chance (p = 0.0003 with the policy of commit 079ff6c; seeds 44-50 gave 0.24-0.98, and 10,000
    # samples of this seed 0.86), where a biased policy's p only falls with more samples.
    right, _, _ = run_drafter(config, lambda o, d: toy_auto_drafter(d, True), N_CONTROL)
    assert wrong < ALPHA, f"a drafter that reads the oracle's draw passed: p = {wrong:.3g}"
    assert right > ALPHA, f"auto failed on the control's configuration: p = {right:.3g}"


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


VERIFIERS = {"walk": verify, "batched": verify_sampled}  # `verify` walks on a CPU; CUDA logits take `verify_sampled`


def cuda_dispatch_verify(tree: TokenTree, logits: Tensor, sampling: SamplingParams, generator: Gen) -> VerifyResult:
    """What `verify` runs when the logits live on a GPU: the greedy walk at T=0, else the batched `verify_sampled`.

    On a CPU `verify` walks node by node, so without this the producers tested on the CPU (stage chains, whose
    inner loops call `verify` too, `auto`, feature drafts, static-runner trees) never reach the batched rules.
    """
    if sampling.greedy:
        return verify_greedy(tree, logits)
    return verify_sampled(tree, logits, sampling, generator)


def use_verifier(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make every loop verify with `name` ("walk": `verify` as a CPU runs it; "batched": as CUDA runs it).

    Patched where the loop looks it up (`stagedspec.generation.verify`, read at each `iter_steps` call), so a
    stage's own inner loop, which passes no verifier, switches with the oracle's.
    """
    if name == "batched":
        monkeypatch.setattr("stagedspec.generation.verify", cuda_dispatch_verify)
    elif name != "walk":
        raise ValueError(name)


def corrupt_batched_leftover(monkeypatch: pytest.MonkeyPatch) -> None:
    """NEGATIVE CONTROL for the batched path: inside the real `verify_sampled`, a node whose children are all
    rejected draws its token from its p instead of what the rejections left (mistake (d) of the walk's controls).

    The acceptance decisions stay right; only `_decide_children`'s leftover is replaced, so a test catching this
    shows that the batched rules themselves, not a stand-in, decide its samples.
    """
    import stagedspec.verification as verification

    real = verification._decide_children

    def leftover_is_p(tree: TokenTree, order: list[list[int]], parents: list[int], probs: Tensor):  # noqa: ANN202
        _, accept_prob, no_q = real(tree, order, parents, probs)
        return probs, accept_prob, no_q

    monkeypatch.setattr(verification, "_decide_children", leftover_is_p)


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_speculative_sampling_matches_the_oracle(config: Config, verifier: str) -> None:
    pvalue, df = run_config(config, N_FAST, VERIFIERS[verifier])
    assert pvalue > ALPHA, f"{config.name}: chi-square p = {pvalue:.3g} (df {df}) with {N_FAST} samples"


def batched_leftover_ignores_rejections(tree: TokenTree, logits: Tensor, sampling: SamplingParams,
                                        generator: Gen) -> VerifyResult:
    """(f) The batched decisions, but a node's next token drawn from its p instead of what its rejections left."""
    n = len(tree)
    order = [[c for c in ks if c not in tree.fixed] + [c for c in ks if c in tree.fixed]
             for ks in tree.children_lists()]
    parents = [u for u in range(n) if order[u]]
    probs = probs_from_logits(logits, sampling).double()
    u_final = torch.rand(n, generator=generator, dtype=torch.float64)
    accept = [False] * n
    if parents:
        u_child = torch.rand(n, generator=generator, dtype=torch.float64)
        accept = (u_child < _decide_children(tree, order, parents, probs)[1]).tolist()
    tokens = inverse_cdf_rows(probs, u_final).tolist()
    node, path = 0, []
    while (nxt := next((c for c in order[node] if accept[c]), None)) is not None:
        node = nxt
        path.append(node)
    return VerifyResult(path, tokens[node])


def test_a_batched_verifier_mistake_is_caught() -> None:
    config = Config("neg-f", S(1.0), "bad", dict(mode="sampled", branching=[3, 2]), seed=25)
    wrong, _ = run_config(config, N_NEGATIVE, batched_leftover_ignores_rejections)
    right, _ = run_config(config, N_NEGATIVE, verify_sampled)
    assert wrong < ALPHA, f"the wrong batched verifier passed: p = {wrong:.3g}"
    assert right > ALPHA, f"the batched verifier failed on the control's configuration: p = {right:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_exactness_high_power(config: Config, verifier: str) -> None:
    """N_SLOW samples: any bias of total variation >= 2% is rejected with power > 0.9."""
    pvalue, df = run_config(config, N_SLOW, VERIFIERS[verifier])
    assert pvalue > ALPHA, f"{config.name}: chi-square p = {pvalue:.3g} (df {df}) with {N_SLOW} samples"


@pytest.mark.parametrize(
    "verifier, record_q, config", [c[1:] for c in NEGATIVE_CONTROLS], ids=[c[0] for c in NEGATIVE_CONTROLS]
)
def test_wrong_verifiers_are_caught(verifier: Callable, record_q: bool, config: Config) -> None:
    """The same test, same sample size, must reject each classic mistake (and accept `verify` there)."""
    wrong, _ = run_config(config, N_NEGATIVE, verifier, record_q)
    right, _ = run_config(config, N_NEGATIVE, verify, record_q)
    assert wrong < ALPHA, f"the wrong verifier passed: p = {wrong:.3g}"
    assert right > ALPHA, f"the correct verifier failed on the control's configuration: p = {right:.3g}"


def _tilt(dist: Dist, tv: float) -> Dist:
    """The least detectable bias of a given TV: p scaled up on half the mass and down on the other half."""
    signs, up, down = {}, 0.0, 0.0
    for p, cell in sorted(((p, c) for c, p in dist.items() if p > 0), reverse=True):
        signs[cell] = 1.0 if up <= down else -1.0
        up, down = (up + p, down) if up <= down else (up, down + p)

    def tilted(eps: float) -> Dist:
        raw = {c: p * (1 + eps * signs.get(c, 0.0)) for c, p in dist.items()}
        z = sum(raw.values())
        return {c: v / z for c, v in raw.items()}

    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisect eps so that TV(p, tilted) == tv
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(abs(v - dist[c]) for c, v in tilted(mid).items()) / 2 < tv else (lo, mid)
    return tilted(hi)


def _rejection_rate(dist: Dist, truth: Dist, n: int, trials: int) -> float:
    cells = list(truth)
    probs = torch.tensor([truth[c] for c in cells], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1234)
    rejected = 0
    for _ in range(trials):
        draws = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen), minlength=len(cells))
        counts = Counter({c: int(k) for c, k in zip(cells, draws) if k})
        rejected += chi_square_pvalue(counts, dist)[0] < ALPHA
    return rejected / trials


@pytest.mark.parametrize("n, tv", [(N_FAST, TV_FAST), (N_SLOW, 0.02)])
def test_power_of_the_test(n: int, tv: float) -> None:
    """The sample sizes do what the module docstring claims, on every configuration's distribution.

    Samples are drawn directly from a distribution at total variation `tv`
    from the oracle's (the least detectable shape); the test must reject at
    least 75% of the time (the claim is ~90%; 40 trials are noisy), and
    (almost) never reject exact samples.
    """
    for config in CONFIGS:
        dist = config.models()[2]
        assert _rejection_rate(dist, _tilt(dist, tv), n, trials=40) >= 0.75, config.name
        assert _rejection_rate(dist, dist, n, trials=10) <= 0.1, config.name


GREEDY_TREES = [
    ("good", dict(mode="topk", tree_budget=8, max_depth=4, branching=3)),
    ("bad", dict(mode="topk", tree_budget=16, max_depth=6, branching=4, width=1)),
    ("good", dict(mode="topk", tree_budget=3, branching=1)),  # a greedy chain
    ("bad", dict(mode="topk", tree_budget=0)),  # autoregressive
]


@pytest.mark.parametrize("draft, tree_kw", GREEDY_TREES, ids=lambda x: str(x))
def test_greedy_is_the_oracle_argmax_continuation(draft: str, tree_kw: dict) -> None:
    for seed in range(20):
        oracle_lm = TableLM(salt=60 + seed)
        drafter = ToyDrafter(TableLM(salt=90 + seed, kind=draft, oracle=oracle_lm), tree_kw)
        prompt = [seed % V, (seed * 3) % V]
        expected = []
        for _ in range(8):
            expected.append(int(oracle_lm.logits(tuple(prompt + expected)).argmax()))
        out = speculative_generate(ToyOracle(oracle_lm), drafter, prompt, max_new_tokens=8, sampling=SamplingParams())
        assert out.token_ids == expected
