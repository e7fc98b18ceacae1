"""Fake kernel timings for `stagedspec.models.matmul_plan.plan_matmuls(measure=...)`: plans forced onto a model
whatever this machine's timings are, so the tests cover every kind of step the planner can choose."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

# (F.linear, (W x^T)^T) cost factors by row-count index modulo 5, on costs doubling per measured count, so
# that `choose` picks, in turn: F.linear as is, (W x^T)^T as is, (W x^T)^T padded to the next count,
# (W x^T)^T as is, F.linear padded to the next count.
_MIXED = ((1.0, 1.0), (1.0, 0.5), (5.0, 5.0), (1.0, 0.5), (5.0, 5.0))


def forced_timings(kind: str):  # noqa: ANN201
    """kind "all": (W x^T)^T at every row count, unpadded; "mixed": the cycle above (both kernels, padded and
    not, at neighbouring row counts: passes of neighbouring sizes round differently)."""
    def measure(weights: Sequence[Tensor], rows: Sequence[int]) -> dict[int, tuple[float, float]]:
        if kind == "all":
            return {n: (2.0 ** i, 0.5 * 2.0 ** i) for i, n in enumerate(rows)}
        return {n: tuple(f * 2.0 ** i for f in _MIXED[i % 5]) for i, n in enumerate(rows)}

    return measure
