"""Adaptive tree budgets: verify as many draft nodes as pay for themselves on this hardware.

A best-first tree lists its nodes with their cumulative draft probability
s_i.  If the draft is calibrated, node i is accepted with probability s_i,
so a tree of the n best nodes yields 1 + sum(s_1..s_n) tokens per step
(linearity: the accepted path's length is the number of accepted nodes).
The step costs the draft's time plus one oracle pass over n + 1 rows, whose
price was measured on this machine (`stagedspec.bench.tree_cost`).  Every
step keeps the n that maximises tokens per second.

Drafts are rarely calibrated, so the predicted sum is scaled by alpha,
the ratio of tokens actually accepted to tokens predicted so far
(starting from 1).  Cutting a deterministic tree to its best nodes depends
only on the draft, never on the oracle's random draws, so it keeps every
verification rule exact.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Mapping, Sequence


class AdaptiveBudget:
    """Picks how many of a tree's best nodes to verify, and learns how far to trust the draft."""

    def __init__(self, pass_seconds: Mapping[int, float], prior_steps: float = 4.0) -> None:
        """`pass_seconds[r]`: seconds of one oracle pass over r rows (root included), measured."""
        if not pass_seconds or min(pass_seconds) < 1 or any(v <= 0 for v in pass_seconds.values()):
            raise ValueError("the cost curve needs positive timings for row counts >= 1")
        self.rows = sorted(pass_seconds)
        self.seconds = [pass_seconds[r] for r in self.rows]
        self.prior = prior_steps
        self.accepted = 0.0  # tokens accepted from the trees so far (root excluded)
        self.predicted = 0.0  # sum of the kept nodes' scores over the same steps
        self.chosen: list[int] = []  # nodes kept per step (telemetry)

    @property
    def alpha(self) -> float:
        """Accepted / predicted tokens, shrunk towards 1 by `prior_steps` worth of a perfect draft."""
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def pass_cost(self, rows: int) -> float:
        """Seconds of one oracle pass over `rows` rows, interpolated (extrapolated past the last point)."""
        i = bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.rows):
            i -= 1  # extend the last segment
        r0, r1, s0, s1 = self.rows[i - 1], self.rows[i], self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def choose(self, scores: Sequence[float], draft_seconds: float) -> int:
        """How many of the nodes (scores of the non-root nodes, any order) to verify."""
        best_n, best_rate, total = 0, 1.0 / (self.pass_cost(1) + draft_seconds), 0.0
        for n, s in enumerate(sorted(scores, reverse=True), start=1):
            total += s
            rate = (1.0 + self.alpha * total) / (self.pass_cost(n + 1) + draft_seconds)
            if rate > best_rate:
                best_n, best_rate = n, rate
        self.chosen.append(best_n)
        return best_n

    def observe(self, predicted: float, accepted: int) -> None:
        """Record one step: the kept nodes' score sum and how many of them the oracle accepted."""
        self.predicted += predicted
        self.accepted += accepted
