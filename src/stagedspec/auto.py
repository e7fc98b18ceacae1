"""`--method auto`: every step, the configuration with the highest expected tokens per second.

Whether speculation pays depends on the machine: on a CPU with native bf16 a
4-row pass costs what a 1-row pass costs and `staged` wins; on an AVX2-only
CPU a bf16 pass over 4 rows costs twice one row and every tree loses; on a
GPU a 64-node tree costs 1.3x one token.  So nothing here is tuned for a
machine.  Each step weighs its candidate configurations (`Arm`s):

- `ar`: no speculation (one token per oracle pass);
- `lookup:k`: prompt-lookup / n-gram chains of up to k tokens;
- `tree:n`: a best-first draft tree of n nodes;
- `staged:k` / `staged:k+m`: the draft decodes k tokens, itself sped up by
  lookup below, with a prompt-lookup chain (k + 1 tokens, or m) merged into
  the oracle's tree;

by expected tokens / expected seconds, where

- seconds = the oracle's pass over the arm's rows and the verification
  around it (the measured cost curve and verification overhead of this
  machine, `stagedspec.costs`, scaled by how long that arm kind's steps
  actually took) + the arm's drafting time (predicted from the drafts' cost
  curves, then measured), all scaled by how the arm kind's whole steps
  compared with that price (from one `propose` to the next: a draft
  catching up on the tokens it missed is charged to its kind);
- tokens = 1 + sum over depths j of P(accepted length >= j), from
  per-proposer, per-depth acceptance statistics (`ChainStats`: context,
  n-gram, draft) that start from priors and are updated after every
  verification, calibrated per arm by what that arm actually yielded
  (shrunk towards what its kind yielded, so an arm tried once is judged by
  its siblings too).

Prompt lookup costs microseconds, so its chains are computed every step and
scored against the tokens the oracle went on to emit, whichever arm ran: its
statistics never go stale.  A draft's statistics are updated whenever an arm
that uses it runs.  A speculative arm must beat `ar` by `MARGIN` to run, so
when the estimates are close the loop decodes plainly.

Exploration.  A step's yield is noisy (1 token one step, 8 the next), so an
arm judged on one unlucky step could be written off for good.  Every
`EXPLORE_EVERY`-th priced step therefore runs the arm with the highest
*optimistic* rate (its calibration raised by `EXPLORE_WIDTH` / sqrt(1 + the
steps it ran), UCB-style), twice in a row so that its drafting time is
measured on a warm draft cache: a step whose drafter did not run the step
before pays for catching up on the tokens decoded meanwhile, which is not
the arm's price and is not learned as such.  An exploration that does not
convince (the next priced step chooses `ar` again) doubles the gap to the
next one, up to `EXPLORE_MAX_GAP`; a priced step that chooses a speculative
arm resets it.  Where plain decoding keeps winning, as for SmolLM2 on an AVX2
EPYC, each exploration cost about two slow steps (a model draft catching up
on the context, then a warm repeat) in every eight priced ones: 7-9% of a
mostly-`ar` request's time there (2026-11-26).

The request's own record.  The models above are shared by every request and
learn slowly on purpose; each request also keeps, per arm kind, the tokens and
wall seconds its steps realized against what they were priced at
(`stagedspec.realized_rates`), and that ratio scales the kind's price for the
rest of the request.  An arm priced a little above `ar` that loses to its
price is dropped within a handful of steps, whichever part of the model erred.

In the batched server (`stagedspec.server`) a request's step is part of a
round whose passes it shares with the other running requests, so an arm is
priced by what it adds to that round (`SharedLoad`, `shared_step_seconds`):
its oracle rows at the margin of the others' rows on the cost curve, its
segment's per-request cost, its draft passes either inside the draft phases
the others already run (their marginal rows) or as new phases (their cost
shared by the requests that would run them), and the round's other tokens and
seconds, measured, in the ratio.  Alone (no others) that is the solo price.

Exactness.  The choice depends on earlier steps (the statistics, the
measured times) and on the drafts' own proposals for this step (whether a
lookup chain exists), never on the oracle's result for this step — the rule
in `stagedspec.verification`'s docstring.  Each arm's tree is then verified
by the ordinary rules, so every arm, and any sequence of arms, is exact.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from stagedspec.costs import CostProfile
from stagedspec.drafters.base import Drafter
from stagedspec.realized_rates import RealizedRates
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree

if TYPE_CHECKING:
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.generation import Oracle

MARGIN = 0.03  # a speculative arm must promise this much more than `ar` to be chosen
LOOKUP_SIZES = (1, 2, 3, 4, 6)
CPU_TREE_SIZES = (2, 4, 8, 16)
CUDA_TREE_SIZES = (2, 4, 8, 16, 32, 64)
STAGE_SIZES = (1, 2, 3, 4, 6)
# `staged:k+m` arms also merge a long chain: where verification rows are nearly free (a CPU with native bf16,
# a GPU) the copies it catches are long; where rows are dear the pricing leaves these arms alone.  The fixed
# `staged` merges this many on a native-bf16 CPU (AMX Xeon, 2026-11-23: 1.75x -> 1.78-1.87x `ar`; docs/benchmarks.md).
STAGE_LONG_LOOKUP = 8
# A `staged:k` arm merges a prompt-lookup chain one token longer than its draft's k, as the tuned fixed
# configurations do (bf16: 3 draft + 4 lookup; int4: 1 + 2, which no arm could express without this: `auto@int4`
# ran at 1.10-1.17x `ar@int4` against `staged@int4`'s 1.35x on an AMX Xeon, 2026-11-23).
STAGE_LOOKUP_EXTRA = 1
# Priors: mean per-depth acceptance of each proposer before any observation, and its weight in steps.
PRIOR_ACCEPTANCE = {"context": 0.5, "ngram": 0.3, "draft": 0.6}
PRIOR_WEIGHT = 2.0
ARM_PRIOR_STEPS = 10.0  # how many steps' worth the model's prediction counts against an arm's own record
EXPLORE_EVERY = 8  # every this many priced steps, run the arm with the highest optimistic rate ...
EXPLORE_MAX_GAP = 64  # ... a gap doubled, up to this, each time `ar` wins the priced step after an exploration
EXPLORE_WIDTH = 0.5  # ... its calibration raised by this / sqrt(1 + steps it ran), twice in a row (the first
# step may catch its draft up, and its drafting time is then not learned)
SECOND_CHOICE = 0.5  # P(a node's next child is right | the ones before it were wrong) / the first's P(right)
LOOKUP_SECONDS = 2e-4  # prior for a lookup proposal's cost, before it is measured
STAGE_INNER_ACCEPT = 1.5  # prior tokens per draft pass when the draft is itself sped up by lookup
PLAIN_STREAK = 8  # after this many `ar` steps in a row, lookup chains are computed only ...
LOOKUP_PROBE_EVERY = 4  # ... every this many steps
AR_PROBE_EVERY = 32  # a step runs `ar` when its time was last measured this many steps ago ...
AR_PROBE_BELOW = 1.5  # ... and the best arm promises less than this many times `ar`'s rate, or `ar` ran ...
AR_PROBE_MIN_STEPS = 8  # ... fewer steps than this (its price is then too little measured to trust)
STATE_CAP = 200.0  # observations per series kept when the learned state is saved for the next process
# Observations per series of the shared statistics a request starts from (`AutoDrafter.begin`): how often a
# draft or the prompt's own text is right depends on the request (code that restates its prompt, prose that
# does not), so a request's choices follow its own record after a dozen or two steps.  A synthetic request
# whose prompt is never copied, priced from a machine that saw it always copied, left lookup after 23 steps
# with 8 and ran lookup still after 60 with all 200 (`tests/test_auto.py`).  Priced from the machine's 200
# observations, `auto` on the Qwen2.5-Coder pair ran prose at 0.78x `ar` after a run of HumanEval prompts
# had taught it that the prompt is copied (AVX2 EPYC, 2026-11-26).
REQUEST_PRIOR = 8.0


@dataclass(frozen=True)
class Arm:
    """One configuration `--method auto` can run for a step."""

    kind: str  # "ar" | "lookup" | "tree" | "staged"
    size: int = 0  # lookup chain length / tree nodes / tokens the draft stage decodes
    lookup: int = 0  # staged: tokens of the merged prompt-lookup chain (0: size + STAGE_LOOKUP_EXTRA)

    @property
    def name(self) -> str:
        if self.kind == "ar":
            return "ar"
        return f"{self.kind}:{self.size}" + (f"+{self.lookup}" if self.lookup else "")

    @property
    def family(self) -> str:
        """Arms the chain model prices alike, whose calibrations are pooled (`AcceptanceStats.calibration`):
        the kind, with `staged` arms merging a long lookup chain apart (the model overrates that chain)."""
        return f"{self.kind}+" if self.lookup else self.kind

    @property
    def max_tree_budget(self) -> int:
        """Most non-root nodes this arm can put in the oracle's tree."""
        if self.kind == "lookup":
            return 3 * self.size  # the context chain and two n-gram chains
        if self.kind == "staged":
            return self.size + staged_lookup_length(self)  # the draft's chain and the merged context chain
        return self.size


def arms_for(has_lookup: bool, has_draft: bool, device: str = "cpu", kind: str | None = None) -> list[Arm]:
    """Every configuration worth pricing, given what can propose; `kind`: only `ar` and that kind's arms
    (a method whose sizes are measured, `SpeculationConfig.sizing`)."""
    if kind is not None:
        return [a for a in arms_for(has_lookup, has_draft, device) if a.kind in ("ar", kind)]
    arms = [Arm("ar")]
    if has_lookup:
        arms += [Arm("lookup", k) for k in LOOKUP_SIZES]
    if has_draft:
        sizes = CUDA_TREE_SIZES if device.startswith("cuda") else CPU_TREE_SIZES
        arms += [Arm("tree", n) for n in sizes]
        arms += [Arm("staged", k) for k in STAGE_SIZES]
        arms += [Arm("staged", k, STAGE_LONG_LOOKUP) for k in STAGE_SIZES if k + STAGE_LOOKUP_EXTRA < STAGE_LONG_LOOKUP]
    return arms


def tree_depth_for(nodes: int) -> int:
    """The depth of an n-node tree arm: deep enough for long accepts, wide enough to hedge."""
    return max(1, min(nodes, round(1.5 * math.sqrt(nodes)) + 1, 8))


class ChainStats:
    """Per-depth acceptance of one proposer's chain: P(depth d accepted | depth d - 1 accepted).

    Depth d's estimate shrinks towards depth d - 1's (towards the prior at
    depth 1) with `weight` pseudo-observations, so deep, rarely reached
    depths borrow strength from shallow ones.
    """

    def __init__(self, prior: float, weight: float = PRIOR_WEIGHT) -> None:
        self.prior, self.weight = prior, weight
        self.hits: list[float] = []
        self.tries: list[float] = []
        # Per-depth rates and reach curves, kept until the counts change: the policy prices every arm
        # every step, and on a GPU a step is 3 ms, so recomputing them cost a sixth of it.
        self._rates: list[float] = []
        self._reach: dict[int, list[float]] = {}
        self._trees: dict[tuple[int, int], float] = {}

    def set_counts(self, hits: list[float], tries: list[float]) -> None:
        """Replace the counts (a restored state)."""
        self.hits, self.tries = list(hits), list(tries)
        self._rates, self._reach, self._trees = [], {}, {}

    def record(self, matched: int, length: int) -> None:
        """A chain of `length` tokens whose first `matched` were accepted (the next one, if any, rejected)."""
        for d in range(min(matched + 1, length)):
            while len(self.tries) <= d:
                self.tries.append(0.0)
                self.hits.append(0.0)
            self.tries[d] += 1
            self.hits[d] += d < matched
        self._rates, self._reach, self._trees = [], {}, {}

    def rate(self, depth: int) -> float:
        """P(the node at 0-based `depth` is accepted | its parent was)."""
        rates = self._rates
        mean = rates[-1] if rates else self.prior
        for d in range(len(rates), depth + 1):
            hits = self.hits[d] if d < len(self.hits) else 0.0
            tries = self.tries[d] if d < len(self.tries) else 0.0
            mean = (hits + self.weight * mean) / (tries + self.weight)
            rates.append(mean)
        return rates[depth]

    def reach(self, length: int) -> list[float]:
        """P(accepted length >= j) for j = 1..length, of a chain."""
        cached = self._reach.get(length)
        if cached is not None:
            return cached
        out, p = [], 1.0
        for d in range(length):
            p *= self.rate(d)
            out.append(p)
        self._reach[length] = out
        return out

    def best_first(self, nodes: int, depth: int) -> float:
        """Expected accepted nodes of a best-first tree of `nodes` nodes at most `depth` deep.

        The tree is grown as the drafter grows its own, by the probability
        that a node lies on the accepted path, here from the per-depth rates:
        a node's first child is right with the depth's rate a, each further
        child with `SECOND_CHOICE` * a of what the ones before it left.
        Siblings exclude each other, so the expectation is the sum of the
        chosen nodes' probabilities.  (Spreading the nodes evenly over the
        levels instead priced a 16-node tree at 3.3 tokens where it yielded
        2.7, and so picked it over the arms that were faster.)
        """
        cached = self._trees.get((nodes, depth))
        if cached is not None:
            return cached

        def child(parent: float, d: int, rank: int) -> float:
            a = self.rate(d)
            if rank == 0:
                return parent * a
            second = SECOND_CHOICE * a
            return parent * (1.0 - a) * (1.0 - second) ** (rank - 1) * second

        total, heap = 0.0, [(-child(1.0, 0, 0), 0, 0, 1.0)]  # (-P(on path), depth, rank, parent's P)
        for _ in range(nodes):
            if not heap:
                break
            neg, d, rank, parent = heapq.heappop(heap)
            total -= neg
            heapq.heappush(heap, (-child(parent, d, rank + 1), d, rank + 1, parent))
            if d + 1 < depth:
                heapq.heappush(heap, (-child(-neg, d + 1, 0), d + 1, 0, -neg))
        self._trees[(nodes, depth)] = total
        return total


@dataclass
class AcceptanceStats:
    """What the policy has learned about acceptance: per proposer and depth, and per arm."""

    chains: dict[str, ChainStats] = field(
        default_factory=lambda: {k: ChainStats(v) for k, v in PRIOR_ACCEPTANCE.items()})
    arm_tokens: dict[Arm, float] = field(default_factory=dict)  # sum of (tokens - 1) the arm yielded
    arm_predicted: dict[Arm, float] = field(default_factory=dict)  # sum of (predicted tokens - 1)
    arm_steps: dict[Arm, float] = field(default_factory=dict)
    # Family calibrations, kept until an arm is observed: every arm is priced every step.
    families: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def calibration(self, arm: Arm) -> float:
        """Actual / predicted accepted tokens of `arm` so far, shrunk by `ARM_PRIOR_STEPS` towards its family's
        (`family_calibration`): the chain model errs alike for the sizes of one kind, so an arm tried once or
        never is priced by what its siblings yielded, and one unlucky step moves it less."""
        steps = self.arm_steps.get(arm, 0)
        towards = self.family_calibration(arm.family)
        if not steps:
            return towards
        predicted = self.arm_predicted.get(arm, 0.0)
        per_step = predicted / steps if predicted > 0 else 1.0
        prior = ARM_PRIOR_STEPS * per_step
        return (self.arm_tokens.get(arm, 0.0) + towards * prior) / (predicted + prior)

    def family_calibration(self, family: str) -> float:
        """Actual / predicted accepted tokens of all arms of `family` (`Arm.family`), shrunk towards 1 by
        `ARM_PRIOR_STEPS`."""
        cached = self.families.get(family)
        if cached is not None:
            return cached
        steps = tokens = predicted = 0.0
        for arm, n in self.arm_steps.items():
            if arm.family == family:
                steps += n
                tokens += self.arm_tokens.get(arm, 0.0)
                predicted += self.arm_predicted.get(arm, 0.0)
        prior = ARM_PRIOR_STEPS * (predicted / steps if predicted > 0 else 1.0)
        value = (tokens + prior) / (predicted + prior) if steps else 1.0
        self.families[family] = value
        return value

    def scaled(self, cap: float) -> AcceptanceStats:
        """A copy whose every series counts at most `cap` observations (the rates and calibrations are kept;
        the weight of the evidence behind them is not)."""
        out = AcceptanceStats()
        for name, c in self.chains.items():
            f = min(1.0, cap / c.tries[0]) if c.tries and c.tries[0] > 0 else 1.0
            chain = ChainStats(c.prior, c.weight)
            chain.set_counts([h * f for h in c.hits], [t * f for t in c.tries])
            out.chains[name] = chain
        for arm, steps in self.arm_steps.items():
            f = min(1.0, cap / steps) if steps > 0 else 1.0
            out.arm_steps[arm] = steps * f
            out.arm_tokens[arm] = self.arm_tokens.get(arm, 0.0) * f
            out.arm_predicted[arm] = self.arm_predicted.get(arm, 0.0) * f
        return out

    def observe(self, arm: Arm | None, predicted_tokens: float, tokens: int,
                chains: Sequence[tuple[str, int, int]]) -> None:
        """One step's lesson: `chains` (proposer, matched, length) scored against the emitted tokens, and `arm`
        (None: no arm's step to judge) with the tokens it was predicted to and did emit."""
        for name, matched, length in chains:
            self.chains[name].record(matched, length)
        if arm is not None:
            self.observe_arm(arm, predicted_tokens, tokens)

    def observe_arm(self, arm: Arm, predicted_tokens: float, tokens: int) -> None:
        self.families.clear()
        self.arm_steps[arm] = self.arm_steps.get(arm, 0) + 1
        self.arm_predicted[arm] = self.arm_predicted.get(arm, 0.0) + max(0.0, predicted_tokens - 1.0)
        self.arm_tokens[arm] = self.arm_tokens.get(arm, 0.0) + max(0, tokens - 1)


@dataclass
class StepCosts:
    """What the policy has measured about time: drafting per arm, and how real steps compare to the curve."""

    draft_seconds: dict[Arm, float] = field(default_factory=dict)  # running mean per arm
    verify_scale: float = 1.0  # measured verification time / the cost curve's prediction, all steps
    # The same per arm kind and decoding mode ("tree/sampled"): verifying a tree costs host work that
    # the cost curve (a pass) does not show, and `ar`'s step has the least.  One scale for all would
    # charge `ar` the trees' extra work (on an H100, 2026-11-23, greedy: tree steps took 1.93x the curve,
    # `ar` steps 1.10x).
    verify_scales: dict[str, float] = field(default_factory=dict)
    # Per arm kind, measured drafting time / the cost curves' prediction: an arm not run yet is priced
    # by what its siblings taught (a GPU draft pass costs far more than its graph replay once the tree
    # building around it is counted), so every size need not be tried to learn that.
    draft_scale: dict[str, float] = field(default_factory=dict)
    # What whole steps cost against their calibrated price, per arm kind and decoding mode ("staged/sampled"):
    # the wall time from one `propose` to the next, so a step whose draft first runs over
    # every token it missed (after a run of `ar` steps; the whole prompt the first time), an exploration's
    # loss and the bookkeeping around a tree are all charged to what caused them.  The parts above leave
    # those out (a cold draft's time is not its arm's price); without this `auto` ran at 0.89-0.96x `ar`
    # on an AVX2 EPYC (SmolLM2, 2026-11-25) while each part's estimate was close.
    step_scales: dict[str, float] = field(default_factory=dict)
    verify_counts: dict[str, int] = field(default_factory=dict)  # steps behind each of `verify_scales` (this run)

    def step_scale_for(self, kind: str, sampled: bool) -> float:
        """Measured / calibrated seconds of whole steps of this arm kind (1 until seen): a draft's catch-up
        falls on the kind whose drafter it is (tree arms share one, staged arms another)."""
        return self.step_scales.get(_verify_key(kind, sampled), 1.0)

    def observe_step(self, arm: Arm, wall_seconds: float, predicted: float, sampled: bool) -> None:
        """Fold in one whole step: `wall_seconds` from its `propose` to the next, against `predicted` (the
        calibrated price without this scale).  Clipped like the others, so one stall does not rule."""
        if predicted > 0 and wall_seconds > 0:
            ratio = min(4.0, max(0.25, wall_seconds / predicted))
            key = _verify_key(arm.kind, sampled)  # from 1: the parts' scales already took the first lesson
            self.step_scales[key] = 0.9 * self.step_scales.get(key, 1.0) + 0.1 * ratio

    def verify_scale_for(self, kind: str, sampled: bool) -> float:
        """Measured / predicted verification time of a step of this arm kind (all steps' scale until seen)."""
        return self.verify_scales.get(_verify_key(kind, sampled), self.verify_scale)

    def draft_estimate(self, arm: Arm, predicted: float) -> float:
        """Seconds of `arm`'s drafting: its own record, else the prediction scaled by its kind's record."""
        seen = self.draft_seconds.get(arm)
        return seen if seen is not None else predicted * self.draft_scale.get(arm.kind, 1.0)

    def observe(self, arm: Arm, draft_seconds: float | None, verify_seconds: float, predicted_verify: float,
                predicted_draft: float, sampled: bool = False) -> None:
        """Fold in one step's times; `draft_seconds=None`: the drafting time is not the arm's (its draft
        caught up on the tokens other arms decoded), so only the verification is learned.

        Single outliers are clipped to 3x the current estimate (the prediction
        before the first observation).
        """
        if draft_seconds is not None:
            self._observe_draft(arm, draft_seconds, predicted_draft)
        if predicted_verify > 0 and verify_seconds > 0:
            ratio = min(4.0, max(0.25, verify_seconds / predicted_verify))
            self.verify_scale = 0.9 * self.verify_scale + 0.1 * ratio
            key = _verify_key(arm.kind, sampled)
            # a mean of the first steps, then a moving average: one cold first step does not set the price
            n = self.verify_counts.get(key, 0)
            scale = self.verify_scales.get(key, ratio)
            w = max(0.1, 1.0 / (n + 1))
            self.verify_scales[key] = (1 - w) * scale + w * ratio
            self.verify_counts[key] = n + 1

    def _observe_draft(self, arm: Arm, draft_seconds: float, predicted_draft: float) -> None:
        if predicted_draft > 0 and draft_seconds > 0:
            ratio = min(20.0, max(0.05, draft_seconds / predicted_draft))
            scale = self.draft_scale.get(arm.kind)
            self.draft_scale[arm.kind] = ratio if scale is None else 0.8 * scale + 0.2 * ratio
        old = self.draft_seconds.get(arm)
        first = old is None
        old = predicted_draft if first else old
        clipped = min(3.0 * old, max(old / 3.0, draft_seconds)) if old > 0 else draft_seconds
        self.draft_seconds[arm] = clipped if first else 0.8 * old + 0.2 * clipped


def _verify_key(kind: str, sampled: bool) -> str:
    return f"{kind}/{'sampled' if sampled else 'greedy'}"


def solo_step_seconds(arm: Arm, profile: CostProfile, costs: StepCosts, lookup_lengths: Mapping[str, int],
                      sampled: bool = False, whole: bool = True) -> float:
    """Expected seconds of a step of `arm` priced alone: its verification (the cost curve with the host work
    around it, scaled as that arm kind's steps measured) and its drafting (measured, else predicted);
    `whole`: times the whole-step scale (`StepCosts.step_scales`), which the steps teach against the rest."""
    seconds = costs.verify_scale_for(arm.kind, sampled) * profile.step_seconds(verify_rows(arm, lookup_lengths),
                                                                            sampled)
    seconds += costs.draft_estimate(arm, predicted_draft_seconds(arm, profile, sampled))
    return seconds * costs.step_scale_for(arm.kind, sampled) if whole else seconds


def expected_tokens(arm: Arm, stats: AcceptanceStats, lookup_lengths: Mapping[str, int],
                    calibrated: bool = True, optimism: float = 0.0) -> float:
    """Tokens a step of `arm` is expected to emit (its accepted draft tokens + the oracle's own).

    `lookup_lengths`: how long this step's context and n-gram chains are (a
    proposer with no chain now cannot be accepted now).  `calibrated=False`:
    the chains' prediction alone, without the arm's actual/predicted factor;
    that factor is learned against this raw prediction (a prediction that
    already included it would make the factor settle at the square root of
    the true ratio).  `optimism`: the factor is raised by this / sqrt(1 +
    the arm's steps) (an exploring step's upper confidence bound).
    """
    if arm.kind == "ar":
        return 1.0
    chains = stats.chains
    factor = stats.calibration(arm) if calibrated else 1.0
    if optimism:
        factor += optimism / math.sqrt(1.0 + stats.arm_steps.get(arm, 0))
    if arm.kind == "tree":
        return 1.0 + factor * chains["draft"].best_first(arm.size, tree_depth_for(arm.size))
    if arm.kind == "lookup":
        reach = _best_reach([chains["context"].reach(min(arm.size, lookup_lengths.get("context", 0))),
                             chains["ngram"].reach(min(arm.size, lookup_lengths.get("ngram", 0)))])
    else:  # staged: the draft's chain, with the prompt-lookup chain merged in
        merged = min(staged_lookup_length(arm), lookup_lengths.get("context", 0))
        reach = _union_reach(chains["draft"].reach(arm.size), chains["context"].reach(merged))
    return 1.0 + factor * sum(reach)


def _best_reach(curves: Iterable[list[float]]) -> list[float]:
    """Per depth, the best of several chains' P(accepted >= j) (a lower bound for their union)."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    return [max(c[j] if j < len(c) else 0.0 for c in curves) for j in range(max(map(len, curves)))]


def _union_reach(a: list[float], b: list[float]) -> list[float]:
    """Per depth, P(either of two chains is accepted to that depth) were they independent.

    A `staged` tree holds both chains, and the oracle takes the longer match:
    the draft is often right where the prompt has nothing to copy, and the
    other way round, so their union reaches further than either (the best
    of the two, `_best_reach`, would price a draft's k as next to worthless
    beside a long lookup chain).  They are not independent (both are right
    on easy tokens); the arm's calibration takes up the difference.
    """
    n = max(len(a), len(b))
    return [1.0 - (1.0 - (a[j] if j < len(a) else 0.0)) * (1.0 - (b[j] if j < len(b) else 0.0)) for j in range(n)]


def verify_rows(arm: Arm, lookup_lengths: Mapping[str, int]) -> int:
    """Rows of the oracle's pass for `arm` (root included)."""
    if arm.kind == "ar":
        return 1
    if arm.kind == "lookup":
        return 1 + min(arm.size, lookup_lengths.get("context", 0)) + 2 * min(arm.size, lookup_lengths.get("ngram", 0))
    if arm.kind == "staged":
        return 1 + arm.size + min(staged_lookup_length(arm), lookup_lengths.get("context", 0))
    return 1 + arm.size


def staged_lookup_length(arm: Arm) -> int:
    """Tokens of the prompt-lookup chain a `staged` arm merges into the oracle's tree."""
    return arm.lookup or arm.size + STAGE_LOOKUP_EXTRA


def lookup_horizon(arms: Iterable[Arm]) -> int:
    """The longest prompt-lookup chain any of `arms` proposes (so the chains scored every step reach it)."""
    lengths = [a.size for a in arms if a.kind == "lookup"] + [staged_lookup_length(a) for a in arms
                                                              if a.kind == "staged"]
    return max(lengths, default=max(LOOKUP_SIZES))


def predicted_draft_seconds(arm: Arm, profile: CostProfile, sampled: bool = False) -> float:
    """Drafting time of one step of `arm`, from the drafts' measured cost curves (before any is measured).

    Each draft pass also costs the host work around it (growing the tree,
    sampling, bookkeeping), measured once with the curves
    (`CostProfile.draft_overhead`): on a GPU that is most of a draft pass.
    """
    if arm.kind == "ar":
        return 0.0
    if arm.kind == "lookup" or not profile.drafts:
        return LOOKUP_SECONDS
    extra = profile.draft_pass_overhead(sampled)
    catch_up = profile.draft_seconds(0, 2)  # the last step's accepted tokens, run through the draft
    if arm.kind == "tree":
        depth = tree_depth_for(arm.size)
        return catch_up + depth * (profile.draft_seconds(0, min(8, math.ceil(arm.size / depth) + 1)) + extra)
    passes = math.ceil(arm.size / STAGE_INNER_ACCEPT)
    return LOOKUP_SECONDS + catch_up + passes * (profile.draft_seconds(0, 3) + extra)


@dataclass(frozen=True)
class SharedLoad:
    """One request's view, before its step, of the batched round it is about to share (the server's state).

    Built by the scheduler from the rounds already run (`stagedspec.server.scheduler`), never from the
    round in progress, so the step's tree shape depends only on history and server state known before it.
    `others`: the other requests in the round.  `oracle_rows`: the rows their steps put in the round's
    oracle pass.  `draft_phases`: draft passes the others' steps run (the round's draft phases: a lane's
    k-th draft pass joins the k-th ragged draft pass), `draft_rows`: their rows per such phase.
    `seconds` / `tokens`: the others' share of a round's measured wall time and of its emitted tokens.
    """

    others: int = 0
    oracle_rows: float = 0.0
    draft_phases: int = 0
    draft_rows: float = 0.0
    seconds: float = 0.0
    tokens: float = 0.0
    # Measured / predicted time of the recent rounds' oracle passes, and of the rest of their rounds (draft
    # passes and the lanes' host work around them): the cost profile, solo and quiet-machine, scaled to the
    # shared passes as they run.
    oracle_scale: float = 1.0
    draft_scale: float = 1.0

    @property
    def requests(self) -> int:
        """Requests in the round, this one included."""
        return self.others + 1


def draft_pass_rows(arm: Arm) -> list[int]:
    """Rows of each draft pass of one step of `arm` (the first: catching the draft up on the last step's
    tokens), as `predicted_draft_seconds` counts them."""
    if arm.kind == "tree":
        depth = tree_depth_for(arm.size)
        return [2] + [min(8, math.ceil(arm.size / depth) + 1)] * depth
    if arm.kind == "staged":
        return [2] + [3] * math.ceil(arm.size / STAGE_INNER_ACCEPT)
    return []


def shared_step_seconds(arm: Arm, profile: CostProfile, load: SharedLoad, lookup_lengths: Mapping[str, int],
                        sampled: bool = False) -> float:
    """Seconds `arm`'s step adds to a batched round shared with `load.others` requests.

    - oracle: its rows at the margin of the others' rows on the cost curve, cost(R + r) - cost(R) (the
      pass's fixed cost is paid by the round whatever this request runs), plus its segment's own cost;
    - drafting: each draft pass inside the phases the others already run costs its marginal rows and its
      segment; a pass beyond them opens a new phase, priced as if every request in the round ran it
      (its cost over `requests`): phases are shared, so one request pricing a new phase alone would keep
      all from opening one even when all would gain (with identical requests, a request's gain and its
      share of the cost scale alike, so the choice is the round's best common arm);
    - plus the host work around each draft pass (`draft_overhead`), which the lanes do one at a time.

    With no others this is the solo price (`expected_rates`' seconds with unit scales).
    """
    rows = verify_rows(arm, lookup_lengths)
    base = load.oracle_rows
    if load.others and base > 0:
        seconds = profile.oracle_seconds(base + rows) - profile.oracle_seconds(base) + profile.segment_cost(-1)
    else:
        seconds = profile.oracle_seconds(rows)
    seconds *= load.oracle_scale
    if arm.kind == "ar":
        return seconds
    if arm.kind == "lookup" or not profile.drafts:
        return seconds + LOOKUP_SECONDS
    return seconds + load.draft_scale * _shared_draft_seconds(arm, profile, load, sampled)


def _shared_draft_seconds(arm: Arm, profile: CostProfile, load: SharedLoad, sampled: bool) -> float:
    """`shared_step_seconds`' drafting part, unscaled."""
    seconds = 0.0
    extra = profile.draft_pass_overhead(sampled)
    n, phases, per_phase = load.requests, load.draft_phases if load.others else 0, load.draft_rows
    if arm.kind == "staged":
        seconds += LOOKUP_SECONDS
    for k, r in enumerate(draft_pass_rows(arm)):
        if k < phases:
            seconds += profile.draft_seconds(0, per_phase + r) - profile.draft_seconds(0, per_phase)
            seconds += profile.segment_cost(0)
        else:
            seconds += profile.draft_seconds(0, n * r) / n + profile.segment_cost(0) * (n - 1) / n
        if k:
            seconds += extra
    return seconds


def catch_up_seconds(arm: Arm, profile: CostProfile, backlog: int) -> float:
    """Seconds a model-drafting arm's draft spends on the `backlog` context tokens it has not run yet beyond
    the two a step normally brings (after a run of `ar` steps; the whole prompt before its first step)."""
    if arm.kind not in ("tree", "staged") or not profile.drafts or backlog <= 2:
        return 0.0
    return max(0.0, profile.draft_seconds(0, backlog) - profile.draft_seconds(0, 2))


def expected_rates(
    arms: Sequence[Arm], profile: CostProfile, stats: AcceptanceStats, costs: StepCosts,
    lookup_lengths: Mapping[str, int], sampled: bool = False, load: SharedLoad | None = None,
    optimism: float = 0.0, catch_up: Mapping[str, float] | None = None, realized: RealizedRates | None = None,
) -> dict[Arm, float]:
    """Expected tokens per second of each arm: a pure function of the costs, the statistics and the load.

    With a `load` of other requests (the batched server), an arm's rate is the round's: (the others'
    tokens + the arm's) / (the others' seconds + what the arm adds to the round), the others' measured.
    `optimism`: upper confidence bounds instead (`expected_tokens`), for an exploring step.
    `catch_up`: seconds each arm kind's draft must first spend catching up, charged to this step.
    `realized`: the request's realized / priced rate per arm kind (`RealizedRates`), applied to solo prices.
    """
    rates = {}
    for arm in arms:
        tokens = expected_tokens(arm, stats, lookup_lengths, optimism=optimism)
        extra = (catch_up or {}).get(arm.kind, 0.0)
        if load is not None and load.others and load.seconds > 0:
            seconds = shared_step_seconds(arm, profile, load, lookup_lengths, sampled) + extra
            rates[arm] = (load.tokens + tokens) / (load.seconds + seconds)
            continue
        rate = tokens / (solo_step_seconds(arm, profile, costs, lookup_lengths, sampled) + extra)
        rates[arm] = rate * realized.factor(arm.kind) if realized is not None else rate
    return rates


def choose_arm(
    arms: Sequence[Arm], profile: CostProfile, stats: AcceptanceStats, costs: StepCosts,
    lookup_lengths: Mapping[str, int], sampled: bool = False, load: SharedLoad | None = None,
    explore: bool = False, catch_up: Mapping[str, float] | None = None, realized: RealizedRates | None = None,
) -> Arm:
    """The arm with the highest expected tokens per second; `ar` unless another beats it by `MARGIN`.

    `load`: the batched round this step shares (`SharedLoad`); None or no others: priced alone.
    `explore`: rank by upper confidence bounds (`EXPLORE_WIDTH`), which favour arms that ran little.
    `realized`: the request's own realized / priced rates (`RealizedRates`), which scale the solo prices."""
    rates = expected_rates(arms, profile, stats, costs, lookup_lengths, sampled, load,
                           EXPLORE_WIDTH if explore else 0.0, catch_up, realized)
    best = max(rates, key=lambda a: rates[a])
    plain = Arm("ar")
    # A shared round's rate moves by about 1/requests of what this request's own rate would: so does the margin.
    margin = MARGIN / load.requests if load is not None and load.others and load.seconds > 0 else MARGIN
    if plain in rates and best != plain and rates[best] < (1.0 + margin) * rates[plain]:
        return plain
    return best


class AutoPolicy:
    """The learned state of `--method auto`, kept across the requests of one pipeline.

    Statistics are kept apart for greedy and sampled decoding (acceptance
    differs), the measured times are shared.  A seeded sampled request gets
    a policy of its own that ignores measured times (`Pipeline.drafter`):
    its tree shapes then depend only on its own history and the machine's
    cached cost profile, so the seed reproduces its output on this machine.
    (Starting it from the state an earlier process saved priced it better,
    but then a seeded request's tokens changed whenever an unseeded one saved
    a new state: a seeded stream under load differed from the same request
    alone.)
    """

    def __init__(self, arms: Sequence[Arm], profile: CostProfile, learn_times: bool = True) -> None:
        """`learn_times=False`: price arms by the cost profile alone, never by measured step times, so
        the choices (and with them a seeded sampled run's random draws) are reproducible."""
        self.arms, self.profile, self.learn_times = list(arms), profile, learn_times
        self.greedy_stats, self.sampled_stats = AcceptanceStats(), AcceptanceStats()
        self.costs = StepCosts()
        self.choices: dict[str, int] = {}
        # The server's batched scheduler runs requests' steps on threads of their own, all learning into
        # one policy: reads and updates of the statistics take this lock (uncontended: ~0.1 us).
        self.lock = threading.RLock()

    def state(self, cap: float = STATE_CAP) -> dict[str, Any]:
        """What was learned, as JSON-able data, counts scaled down to at most `cap` observations per series
        so that a restored policy still adapts to new text."""
        def part(stats: AcceptanceStats) -> dict[str, Any]:
            kept = stats.scaled(cap)
            return {"chains": {name: {"hits": c.hits, "tries": c.tries} for name, c in kept.chains.items()},
                    "arms": {arm.name: [steps, kept.arm_tokens.get(arm, 0.0), kept.arm_predicted.get(arm, 0.0)]
                             for arm, steps in kept.arm_steps.items()}}

        with self.lock:
            return {"version": 1, "greedy": part(self.greedy_stats), "sampled": part(self.sampled_stats),
                    "draft_seconds": {a.name: v for a, v in self.costs.draft_seconds.items()},
                    "verify_scale": self.costs.verify_scale, "verify_scales": dict(self.costs.verify_scales),
                    "draft_scale": dict(self.costs.draft_scale), "step_scales": dict(self.costs.step_scales)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Start from what an earlier process learned on this machine (see `state`); unknown arms are ignored."""
        if state.get("version") != 1:
            return
        by_name = {a.name: a for a in self.arms}
        for key, stats in (("greedy", self.greedy_stats), ("sampled", self.sampled_stats)):
            part = state.get(key, {})
            for name, c in part.get("chains", {}).items():
                if name in stats.chains:
                    stats.chains[name].set_counts([float(x) for x in c["hits"]], [float(x) for x in c["tries"]])
            for name, (steps, tokens, predicted) in part.get("arms", {}).items():
                if name in by_name:
                    arm = by_name[name]
                    stats.arm_steps[arm], stats.arm_tokens[arm], stats.arm_predicted[arm] = steps, tokens, predicted
            stats.families.clear()
        for name, seconds in state.get("draft_seconds", {}).items():
            if name in by_name:
                self.costs.draft_seconds[by_name[name]] = float(seconds)
        self.costs.verify_scale = float(state.get("verify_scale", 1.0))
        self.costs.verify_scales = {str(k): float(v) for k, v in state.get("verify_scales", {}).items()}
        self.costs.verify_counts = {k: 10 for k in self.costs.verify_scales}  # restored: a moving average
        self.costs.draft_scale = {str(k): float(v) for k, v in state.get("draft_scale", {}).items()}
        self.costs.step_scales = {str(k): float(v) for k, v in state.get("step_scales", {}).items()}

    def stats_for(self, sampling: SamplingParams) -> AcceptanceStats:
        return self.greedy_stats if sampling.greedy else self.sampled_stats

    def choose(self, sampling: SamplingParams, lookup_lengths: Mapping[str, int],
               max_tree_budget: int | None = None, load: SharedLoad | None = None, probe_plain: bool = False,
               explore: bool = False, backlog: Mapping[str, int] | None = None, remaining: int = 0,
               stats: AcceptanceStats | None = None, realized: RealizedRates | None = None) -> Arm:
        """The arm to run; `max_tree_budget`: only arms whose trees fit that many nodes (`ar` always does);
        `load`: the batched round the step shares (priced alone when None); `explore`: an exploring step
        (`choose_arm`).

        `backlog`: context tokens each arm kind's draft has not run yet (`AutoDrafter`), `remaining`: tokens
        left to generate.  Catching up is charged whole to an exploring step, which runs twice and then
        likely hands back to `ar` (a run of `ar` steps with explorations every 32 cost SmolLM2 about 4%
        on an AVX2 EPYC, 2026-11-25), and to any other step as its share of the remaining tokens, about
        two a step, since an arm that pays keeps its draft warm from then on.

        `stats`: the acceptance statistics to price with (default: the policy's own for `sampling`; a request
        passes its own, `AutoDrafter`).  `realized`: the request's realized / priced rate per arm kind
        (`stagedspec.realized_rates`), which scales each arm's solo price.

        `probe_plain`: `ar`'s step time has not been measured for a while (`AutoDrafter`): run `ar` now
        if the best arm's promise over it is small enough that `ar`'s true price could change the choice
        (`AR_PROBE_BELOW`).  The other arms' times are measured whenever they run; without probes, `ar`
        would be priced by a scale the others taught once it stopped running.
        """
        arms = self.arms if max_tree_budget is None else [a for a in self.arms if a.max_tree_budget <= max_tree_budget]
        plain = Arm("ar")
        share = 0.5 if explore else min(1.0, 2.0 / max(1, remaining))
        catch_up = {kind: share * catch_up_seconds(Arm(kind), self.profile, n) for kind, n in (backlog or {}).items()}
        with self.lock:
            stats = stats if stats is not None else self.stats_for(sampling)
            arm = choose_arm(arms or [plain], self.profile, stats, self.costs,
                             lookup_lengths, not sampling.greedy, load, explore, catch_up, realized)
            if probe_plain and not explore and arm != plain and plain in arms:
                rates = expected_rates([arm, plain], self.profile, stats, self.costs, lookup_lengths,
                                       not sampling.greedy, load, realized=realized)
                # `ar` timed on too few steps is probed whatever its price says: one slow early step (a cold
                # kernel) can price it far above its time, and it would never run again to show otherwise
                timed = self.stats_for(sampling).arm_steps.get(plain, 0)  # the shared steps: times are shared
                if rates[arm] < AR_PROBE_BELOW * rates[plain] or timed < AR_PROBE_MIN_STEPS:
                    arm = plain
            self.choices[arm.name] = self.choices.get(arm.name, 0) + 1
        return arm

    def choose_plain(self) -> Arm:
        """`ar`, counted like a choice (`AutoDrafter` skips the pricing when nothing new could change it)."""
        return self.choose_again(Arm("ar"))

    def choose_again(self, arm: Arm) -> Arm:
        """`arm` once more without pricing (a plain run, an exploration's second step), counted as a choice."""
        with self.lock:
            self.choices[arm.name] = self.choices.get(arm.name, 0) + 1
        return arm


Resize = Callable[[], None]  # sizes one drafter for an arm (a bound `Drafter.resize`), called before it proposes


@dataclass
class _Step:
    """What the last step proposed, kept until the next `propose` learns how it went."""

    context_len: int
    arm: Arm
    tree: TokenTree
    predicted_tokens: float
    rows: int
    draft_seconds: float
    verify_seconds: float | None = None  # the oracle's pass and verification, reported by the loop
    sampled: bool = False
    warm: bool = True  # its drafter also ran the step before (else its time includes catching up)
    ended: float = 0.0  # when `propose` returned (perf_counter): verification started then
    alone: bool = True  # priced alone (no batched round shared): the time until the next step is its own
    started: float = 0.0  # when `propose` began (perf_counter): the whole step runs from here to the next
    lookup_lengths: Mapping[str, int] = field(default_factory=dict)  # the chains it was priced with
    priced_tokens: float = 1.0  # what it was chosen for: tokens (calibrated) and whole seconds, catch-up included
    priced_seconds: float = 0.0


def spine(tree: TokenTree) -> list[int]:
    """The tokens of the tree's first-child chain: the draft's favourite path (trees are in pre-order)."""
    kids = tree.children_lists()
    node, out = 0, []
    while kids[node]:
        node = kids[node][0]
        if node in tree.fixed:
            break
        out.append(tree.tokens[node])
    return out


def matched_prefix(chain: Sequence[int], emitted: Sequence[int]) -> int:
    n = 0
    while n < len(chain) and n < len(emitted) and chain[n] == emitted[n]:
        n += 1
    return n


class AutoDrafter(Drafter):
    """A drafter that runs, each step, the arm its `AutoPolicy` expects to be fastest.

    `arms` maps each arm to the drafter that proposes for it and the
    `Drafter.resize` calls that size it for the arm (drafters are shared
    between arms of the same kind, so a draft's cache is not caught up once
    per arm size).
    `lookup`, when given, is asked for its chains every step to learn the
    model-free proposers' acceptance and to tell the policy what exists now.
    """

    name = "auto"
    reads_shared_load = True

    def __init__(self, policy: AutoPolicy, arms: Mapping[Arm, tuple[Drafter, Sequence[Resize]]],
                 lookup: LookupDrafter | None = None) -> None:
        self.policy, self.arms, self.lookup = policy, dict(arms), lookup
        missing = [a.name for a in policy.arms if a not in self.arms]
        if missing:
            raise ValueError(f"no drafter for arms {missing}")
        self._drafters = list({id(d): d for d, _ in self.arms.values()}.values())
        self._horizon = lookup_horizon(policy.arms)  # how far this step's lookup chains are scored
        self._last: _Step | None = None
        self._first_step = True  # its times include the prompt's prefill: not a step's cost
        self._plain_streak = 0  # consecutive steps that ran `ar`
        self._since_plain = 0  # steps since `ar` last ran (its step time last measured)
        self._probe_tick = 0
        self._until_explore = EXPLORE_EVERY  # priced steps until the next exploration
        self._explore_gap = EXPLORE_EVERY  # priced steps between explorations (doubled while they fail)
        self._explored = False  # an exploration ran since the last priced step
        self._exploring: Arm | None = None  # the arm an exploration runs again next step
        self._last_drafter: Drafter | None = None  # the drafter of the last step
        self._synced: dict[int, int] = {}  # id(drafter) -> context length when it last proposed
        self.request_choices: dict[str, int] = {}  # `Drafter.request_choices`
        self._pending: list[tuple[int, str, list[int]]] = []  # (context length, proposer, chain) to score
        self._sampling = SamplingParams()
        # This request's own acceptance statistics by sampling kind (greedy?), started from the policy's at
        # `REQUEST_PRIOR` observations and updated with it: the arms are priced by these.
        self._own: dict[bool, AcceptanceStats] = {}
        # This request's realized / priced rate per arm kind (`stagedspec.realized_rates`): it scales the
        # prices, so an arm that loses to its price is dropped within a few steps whatever part of it was wrong.
        self._realized = RealizedRates()
        # Most nodes a tree may have (None: any arm), set by the server under memory pressure
        # (`stagedspec.server.pressure`): arms that could exceed it are not picked, rather than cut.
        self.tree_budget_cap: int | None = None
        # The batched round this request's next step shares, set by the server's scheduler between rounds
        # (never for a seeded sampled request, whose choices must not depend on its neighbours): see
        # `SharedLoad`.  None: priced alone.
        self.shared_load: SharedLoad | None = None

    @property
    def forward_passes(self) -> int:
        return sum(d.forward_passes for d in self._drafters)

    def attach_oracle(self, oracle: Oracle) -> None:
        """Pass the loop's oracle on to the arms that read its hidden states (a feature draft)."""
        for d in self._drafters:
            d.attach_oracle(oracle)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        for d in self._drafters:
            d.begin(prompt_ids)
        if self.lookup is not None and self.lookup not in self._drafters:
            self.lookup.begin(prompt_ids)
        self._last, self._pending, self._first_step = None, [], True
        self._exploring, self._last_drafter = None, None
        self._synced = {}
        self._own = {}
        self._realized = RealizedRates()
        self.request_choices = {}

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        t0 = time.perf_counter()
        self._learn(context, t0)
        self._sampling = sampling
        lengths: dict[str, int] = {}
        due = self._lookup_due()
        if self.lookup is not None and due:
            self.lookup.resize(chain_length=self._horizon)
            for proposer, chain in self.lookup.chains(context, self._horizon):
                if proposer not in lengths:  # the proposer's best chain only
                    lengths[proposer] = len(chain)
                    self._pending.append((len(context), proposer, chain))
        # `ar` too little measured (`AR_PROBE_MIN_STEPS`) is probed every `EXPLORE_EVERY` steps, else every
        # `AR_PROBE_EVERY`: a wrong first price is then corrected within tens of steps, not hundreds
        probe = (self.policy.learn_times and self.shared_load is None and not self._first_step
                 and self._since_plain >= EXPLORE_EVERY)
        if probe and self._since_plain < AR_PROBE_EVERY:  # the statistics are read only when it matters
            with self.policy.lock:
                probe = self.policy.stats_for(sampling).arm_steps.get(Arm("ar"), 0) < AR_PROBE_MIN_STEPS
        again, self._exploring = self._exploring, None
        if again is not None and (self.tree_budget_cap is None or again.max_tree_budget <= self.tree_budget_cap):
            arm = self.policy.choose_again(again)  # an exploration's second step: its time is measured warm
        elif not due and self.shared_load is None:
            # Deep in a run of `ar` steps, between lookup probes: nothing new to weigh (no chains looked at,
            # no draft ran, so no statistic but `ar`'s own time moved), so `ar` again without pricing every
            # arm.  On a GPU that pricing is a few percent of a 3 ms step.  Decided by the history alone.
            arm = self.policy.choose_plain()
        else:
            self._until_explore -= 1
            # A policy that prices by the profile alone (a seeded sampled request's, `Pipeline.drafter`) starts
            # from the priors every request and cannot carry what an exploration teaches to the next one, so
            # it does not explore: on SmolLM2 (AVX2 EPYC, 2026-11-26) seeded T=1 requests of 128 tokens tried
            # 8-10 arms each and ran at 0.92x `ar`.
            explore = self._until_explore <= 0 and self.policy.learn_times
            backlog = {a.kind: len(context) - self._synced.get(id(self.arms[a][0]), 0)
                       for a in self.policy.arms if a.kind in ("tree", "staged")}
            arm = self.policy.choose(sampling, lengths, self.tree_budget_cap, self.shared_load, probe_plain=probe,
                                     explore=explore, backlog=backlog, remaining=max_tokens,
                                     stats=self._own_stats(sampling), realized=self._realized_now())
            self._pace_exploration(arm, explore)
            if explore and arm.kind != "ar":
                self._exploring = arm
        self.request_choices[arm.name] = self.request_choices.get(arm.name, 0) + 1
        self._plain_streak = self._plain_streak + 1 if arm.kind == "ar" else 0
        self._since_plain = 0 if arm.kind == "ar" else self._since_plain + 1
        drafter, resizes = self.arms[arm]
        behind = len(context) - self._synced.get(id(drafter), 0)
        for resize in resizes:
            resize()
        tree = drafter.propose(context, sampling, generator, max_tokens)
        self._synced[id(drafter)] = len(context)
        with self.policy.lock:
            own = self._own_stats(sampling)
            predicted = expected_tokens(arm, own, lengths, calibrated=False)
            priced_tokens = expected_tokens(arm, own, lengths)
            priced_seconds = (solo_step_seconds(arm, self.policy.profile, self.policy.costs, lengths,
                                                not sampling.greedy)
                              + catch_up_seconds(arm, self.policy.profile, behind))
        ended = time.perf_counter()
        self._last = _Step(len(context), arm, tree, predicted, len(tree), ended - t0,
                           sampled=not sampling.greedy, warm=drafter is self._last_drafter, ended=ended,
                           alone=self.shared_load is None, started=t0, lookup_lengths=lengths,
                           priced_tokens=priced_tokens, priced_seconds=priced_seconds)
        self._last_drafter = drafter
        return tree

    def _realized_now(self) -> RealizedRates | None:
        """This request's realized / priced rates, where its steps are timed alone by a policy that learns
        times (not in a batched round, nor for a seeded sampled request priced by the profile alone)."""
        return self._realized if self.policy.learn_times and self.shared_load is None else None

    def _own_stats(self, sampling: SamplingParams) -> AcceptanceStats:
        """This request's acceptance statistics for `sampling`'s kind (made at its first use, under the lock)."""
        own = self._own.get(sampling.greedy)
        if own is None:
            with self.policy.lock:
                own = self._own[sampling.greedy] = self.policy.stats_for(sampling).scaled(REQUEST_PRIOR)
        return own

    def _pace_exploration(self, arm: Arm, explore: bool) -> None:
        """Count down to the next exploration: the gap doubles when `ar` wins the first priced step after an
        exploration of another arm, and returns to `EXPLORE_EVERY` when a priced step chooses to speculate.
        Decided by the history of choices alone."""
        if explore:
            self._until_explore = self._explore_gap
            self._explored = arm.kind != "ar"
            return
        if arm.kind != "ar":
            self._explore_gap = EXPLORE_EVERY
            self._until_explore = min(self._until_explore, self._explore_gap)
        elif self._explored:
            self._explore_gap = min(EXPLORE_MAX_GAP, 2 * self._explore_gap)
            self._until_explore = self._explore_gap
        self._explored = False

    def verified(self, seconds: float) -> None:
        """The loop's report of how long the oracle took to score and verify this drafter's last tree."""
        if self._last is not None:
            self._last.verify_seconds = seconds

    def _lookup_due(self) -> bool:
        """Whether to compute this step's lookup chains (they cost ~0.5 ms of Python).

        While plain decoding keeps winning, they are computed only every
        `LOOKUP_PROBE_EVERY` steps, so a fast pass (a GPU graph replay) does
        not pay for them every step; a run of copyable context is still
        noticed within a few tokens.  Which steps look is decided by the
        history of choices alone.
        """
        self._probe_tick += 1
        return self._plain_streak < PLAIN_STREAK or self._probe_tick % LOOKUP_PROBE_EVERY == 0

    def _learn(self, context: Sequence[int], now: float) -> None:
        """Score the last step and the pending lookup chains against the tokens emitted since (`now`: when
        this step began)."""
        with self.policy.lock:
            self._learn_locked(context, now)

    def _learn_locked(self, context: Sequence[int], now: float) -> None:
        scored: list[tuple[str, int, int]] = []  # (proposer, matched, length) of each chain decided now
        still = []
        for start, proposer, chain in self._pending:
            emitted = context[start:]
            matched = matched_prefix(chain, emitted)
            if matched < len(chain) and matched == len(emitted):
                still.append((start, proposer, chain))  # undecided: the next token is not known yet
            else:
                scored.append((proposer, matched, len(chain)))
        self._pending = still
        last, self._last = self._last, None
        stepped = last is not None and len(context) > last.context_len
        emitted = context[last.context_len:] if stepped else []
        if stepped and last.arm.kind in ("tree", "staged"):
            chain = spine(last.tree)
            if chain:
                scored.append(("draft", matched_prefix(chain, emitted), len(chain)))
        arm = last.arm if stepped else None
        predicted = last.predicted_tokens if stepped else 0.0
        # the machine's statistics (what the next requests start from) and this request's own (its prices)
        self.policy.stats_for(self._sampling).observe(arm, predicted, len(emitted), scored)
        self._own_stats(self._sampling).observe(arm, predicted, len(emitted), scored)
        if not stepped:
            return
        if self._first_step or last.verify_seconds is None or not self.policy.learn_times:
            self._first_step = False
            return
        predicted_verify = self.policy.profile.step_seconds(last.rows, last.sampled)
        # What the step cost after drafting is the time until this step began: the loop's report (scoring,
        # verifying, committing) plus its bookkeeping and the caller's handling of the tokens, which grow
        # with the tree (on an AVX-512 CPU, 1.3 ms for `ar`, 3.7 ms for a 16-node tree).  Capped
        # at 1.5x the report, so a caller that paused between steps does not teach a price.  In a batched
        # round (the server) the time until the next step is the round's, so there the report alone counts.
        verify_seconds = last.verify_seconds
        costs = self.policy.costs
        if last.alone:
            verify_seconds = min(max(verify_seconds, now - last.ended), 1.5 * verify_seconds)
        costs.observe(last.arm, last.draft_seconds if last.warm else None, verify_seconds, predicted_verify,
                      predicted_draft_seconds(last.arm, self.policy.profile, last.sampled), sampled=last.sampled)
        if last.alone:  # a batched round's wall time is the round's, not this step's
            # the whole step against its parts' price after their lesson, so what they explain is not counted
            # twice (a slow first `ar` step once priced `ar` at 2.7x its time and locked it out)
            wall = min(now - last.started, last.draft_seconds + 1.5 * last.verify_seconds)  # not a caller's pause
            costs.observe_step(last.arm, wall,
                               solo_step_seconds(last.arm, self.policy.profile, costs, last.lookup_lengths,
                                                 last.sampled, whole=False), last.sampled)
            self._realized.observe(last.arm.kind, len(emitted), wall, last.priced_tokens, last.priced_seconds)
