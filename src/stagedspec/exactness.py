"""Whether one request's greedy output equals plain decoding's (`--method ar`) bit for bit, and the line that says
so when it may not.

Why: exactness is the product, and a configuration that can lose it must not do so silently.  On the native
quantised kernels every pass is row-exact (`models.quant.row_exact`), and in fp32 the rounding differences
between pass shapes (about 1e-7) have never flipped a token in any test.  A dense bf16/fp16 oracle rounds a row
by its pass's shape (the BLAS picks its kernel by the row count; on a GPU cuBLAS does), so a verification pass can
flip a near-tie that one-token decoding would not: on an NVIDIA H200 with the Qwen2.5-Coder pair in bf16,
`lookup` and `auto` matched `ar` on 15 of 16 prompts, and every method matched on all 16 in fp32
(docs/bench/h200-2026-11-27-qwen-pair/, 2026-11-27).  The batched server's own guarantee is
`stagedspec.server.exactness`.
"""

from __future__ import annotations

import torch
from torch import nn

from stagedspec.models.quant import row_exact


def greedy_exact(model: nn.Module, bit_exact: bool) -> bool:
    """Whether every method's greedy output over `model` is `ar`'s: native kernels, fp32, or bf16 on a CPU with
    `--bit-exact` (`ModelOracle(bit_exact=True)`)."""
    if row_exact(model):
        return True
    weight = next(model.parameters())
    if weight.dtype == torch.float32:
        return True
    return bit_exact and weight.device.type == "cpu"


def greedy_note(model: nn.Module, bit_exact: bool) -> str | None:
    """The one line `generate` prints before a greedy speculative run that may differ from `ar`, else None."""
    if greedy_exact(model, bit_exact):
        return None
    weight = next(model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    fixes = "--dtype fp32" if weight.device.type != "cpu" else \
        "--dtype fp32, --bit-exact or --quant int4/int8/mixed (the native kernels)"
    return (f"stagedspec: note: this {dtype} oracle on {weight.device.type} rounds a row by its pass's shape, so "
            f"greedy output can differ from --method ar's at a near-tie; {fixes} keep it ar's")
