"""What `--method auto` learns about acceptance (per proposer and depth, and per arm), and the tokens a
step of an arm is expected to emit from it."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from stagedspec.auto.arms import Arm, context_chain, staged_lookup_length

# Priors: mean per-depth acceptance of each proposer's series before any observation, and its weight in steps
# (the prompt-lookup chain has a series per matched suffix length, `arms.CONTEXT_SERIES`).
PRIOR_ACCEPTANCE = {"context": 0.5, "context:2": 0.4, "context:1": 0.15, "ngram": 0.3, "draft": 0.6}
PRIOR_WEIGHT = 2.0
ARM_PRIOR_STEPS = 10.0  # how many steps' worth the model's prediction counts against an arm's own record
SECOND_CHOICE = 0.5  # P(a node's next child is right | the ones before it were wrong) / the first's P(right)


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

    def record(self, matched: int, length: int, first: float | None = None) -> None:
        """A chain of `length` tokens whose first `matched` were accepted (the next one, if any, rejected).

        `first`: the probability its first token was accepted (sampled verification), counted at depth 1 in place
        of the draw; the deeper depths count the draws, each given its parent's acceptance."""
        for d in range(min(matched + 1, length)):
            while len(self.tries) <= d:
                self.tries.append(0.0)
                self.hits.append(0.0)
            self.tries[d] += 1
            self.hits[d] += first if d == 0 and first is not None else d < matched
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
    # Family calibrations, each kept until an arm of that family is observed: arms are priced every priced step.
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

    def observe(self, arm: Arm | None, predicted_tokens: float, tokens: float,
                chains: Sequence[tuple[str, int, int, float | None]]) -> None:
        """One step's lesson: `chains` (proposer, matched, length, P(first accepted) or None) scored against the
        emitted tokens, and `arm` (None: no arm's step to judge) with the tokens it was predicted to and did emit
        (a sampled step's first draft token counted by its odds, `AutoDrafter.verified`)."""
        for name, matched, length, first in chains:
            self.chains[name].record(matched, length, first)
        if arm is not None:
            self.observe_arm(arm, predicted_tokens, tokens)

    def observe_arm(self, arm: Arm, predicted_tokens: float, tokens: float, steps: int = 1) -> None:
        """`steps` steps of `arm`, each predicted to and emitting these many tokens."""
        self.families.pop(arm.family, None)  # the other families' pooled calibrations do not move
        self.arm_steps[arm] = self.arm_steps.get(arm, 0) + steps
        self.arm_predicted[arm] = self.arm_predicted.get(arm, 0.0) + steps * max(0.0, predicted_tokens - 1.0)
        self.arm_tokens[arm] = self.arm_tokens.get(arm, 0.0) + steps * max(0, tokens - 1)


def expected_tokens(arm: Arm, stats: AcceptanceStats, lookup_lengths: Mapping[str, int],
                    calibrated: bool = True, optimism: float = 0.0) -> float:
    """Tokens a step of `arm` is expected to emit (its accepted draft tokens + the oracle's own).

    `lookup_lengths`: how long this step's context and n-gram chains are, keyed
    by series (`arms.context_chain`; a proposer with no chain now cannot be
    accepted now).  `calibrated=False`:
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
        return 1.0 + factor * chains["draft"].best_first(arm.size, arm.tree_depth)
    series, copied = context_chain(lookup_lengths)
    if arm.kind == "lookup":
        reach = _best_reach([chains[series].reach(min(arm.size, copied)),
                             chains["ngram"].reach(min(arm.size, lookup_lengths.get("ngram", 0)))])
    elif arm.kind == "copy":
        reach = chains[series].reach(min(arm.size, copied))
    else:  # staged: the draft's chain, with the prompt-lookup chain merged in
        merged = min(staged_lookup_length(arm), copied)
        reach = _union_reach(chains["draft"].reach(arm.size), chains[series].reach(merged))
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

