"""What a server configuration guarantees about a request's output against its solo run.

Why: batched passes put one request's rows in the same matrix products as its neighbours' rows.  On the
native quantised kernels a row's result does not depend on that (`models.quant.row_exact`), so every
request's output is its solo output, bit for bit.  A dense oracle (bf16, fp32 with its row-count plan, a
GPU's BLAS) rounds a row by the pass's shape, so a near-tie can flip.  A user must learn which case they are
in before trusting the output: the server says it at start (`BatchExactness.notice`) and in `/v1/models`
(`BatchExactness.card`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from stagedspec.models.quant import row_exact
from stagedspec.runner import pass_mode


@dataclass(frozen=True)
class BatchExactness:
    """Whether a request's output equals its solo run whatever else the server runs beside it.

    `greedy`: a greedy request's tokens (the oracle's passes decide them; a draft only changes the speed).
    `seeded`: a seeded sampled request's tokens (the drafts' distributions enter its draws too).
    `why`: what breaks it and what to change, "" when both hold.
    """

    greedy: bool
    seeded: bool
    why: str = ""

    def notice(self) -> str | None:
        """The line the server prints at start when a guarantee does not hold, else None."""
        return None if self.greedy and self.seeded else f"stagedspec serve: note: {self.why}"

    def card(self) -> dict[str, Any]:
        """The `stagedspec` field of the server's `/v1/models` entries."""
        return {"exact_under_batching": {"greedy": self.greedy, "seeded": self.seeded}, "note": self.why}


def _passes_exact(model: nn.Module, bit_exact: bool) -> bool:
    """Whether `model`'s rows keep their solo bits in the server's passes."""
    if row_exact(model):
        return True
    if pass_mode(model) != "eager":  # static passes and CUDA graphs keep per-request runners: solo shapes
        return True
    weight = next(model.parameters())
    # --bit-exact: bf16 CPU matmuls round a row alike whatever the row count (docs/serving.md, measured)
    return bit_exact and weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def batch_exactness(model: nn.Module, drafts: Sequence[nn.Module], *, batch_passes: bool,
                    bit_exact: bool) -> BatchExactness:
    """What a server over `model` and `drafts` guarantees (`batch_passes`: `--no-batch-passes` is False)."""
    if not batch_passes:  # interleaved steps: every request runs its solo operations, with its solo shapes
        return BatchExactness(True, True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    fixes = "--quant int8/int4/mixed (the native kernels), --no-batch-passes"
    fixes += "" if bit_exact else " or, in bf16 on a CPU, --bit-exact"
    if not _passes_exact(model, bit_exact):
        return BatchExactness(False, False, (
            f"batched passes of this {dtype} oracle are not row-exact: a request's output can differ from its solo "
            f"run at a near-tie (greedy) or a draw near a boundary (seeded); {fixes} make them equal"))
    if not all(_passes_exact(d, bit_exact) for d in drafts):
        return BatchExactness(True, False, (
            "greedy output equals each request's solo run, but the drafts' batched passes are not row-exact, so a "
            f"seeded sample can differ from its solo run at a draw near a boundary; {fixes} make it equal"))
    return BatchExactness(True, True)
