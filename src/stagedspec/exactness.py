"""Whether one request's greedy output equals plain decoding's (`--method ar`) bit for bit, and the line that says
so when it may not.

Why: exactness is the product, and a configuration that can lose it must not do so silently.  On the native
quantised kernels every pass is row-exact (`models.quant.row_exact`), and in fp32 the rounding differences
between pass shapes (about 1e-7) have never flipped a token in any test.  A dense bf16/fp16 oracle rounds a row
by its pass's shape (the BLAS picks its kernel by the row count; on a GPU cuBLAS does), so a verification pass can
flip a near-tie that one-token decoding would not: on a GPU with the Qwen2.5-Coder pair in bf16, `lookup` and
`auto` did not always match `ar`, where in fp32 every method matched on every prompt
(docs/measurements.md, "Greedy exactness in bf16 and fp32 on an H200").  The batched server's own guarantee is
`stagedspec.server.exactness`.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from stagedspec.hardware import AMX_ISA_CAP, amx_rounds_by_rows
from stagedspec.models.quant import row_exact


def default_bit_exact(model: nn.Module) -> bool:
    """`--bit-exact`'s default for an oracle: on for a dense bf16/fp16 oracle on a GPU, off elsewhere.

    On CUDA the oracle's passes are static (`stagedspec.runner`), and `bit_exact` runs every one of them at one
    row count, so cuBLAS runs one kernel for every pass and no row changes another's bits.  On a GPU with the
    Qwen2.5-Coder pair in bf16 that cost plain decoding a little and made `auto` faster (a 64-row pass is the
    price of every pass, so long lookup chains cost nothing), with every method's greedy output `ar`'s
    (docs/measurements.md, "`--bit-exact` by default on an H200").  On a
    CPU the eager `bit_exact` path costs 10-20% of `ar` and most of what speculation gains, and the default
    for a GGUF there (the native kernels) is row-exact anyway, so it stays a choice.
    """
    weight = next(model.parameters())
    return weight.device.type == "cuda" and weight.dtype in (torch.bfloat16, torch.float16) and not row_exact(model)


def greedy_exact(model: nn.Module, bit_exact: bool) -> bool:
    """Whether every method's greedy output over `model` is `ar`'s: native kernels, fp32, or `--bit-exact`
    (`ModelOracle(bit_exact=True)`: eager passes one token at a time on a CPU, one row count on CUDA)."""
    if row_exact(model):
        return True
    weight = next(model.parameters())
    if weight.dtype == torch.float32:
        return True
    return bit_exact


def greedy_note(model: nn.Module, bit_exact: bool) -> str | None:
    """The one line `generate` prints before a greedy speculative run that may differ from `ar`, else None."""
    if greedy_exact(model, bit_exact):
        return None
    weight = next(model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    fixes = "--dtype fp32 or --bit-exact" if weight.device.type != "cpu" else \
        "--dtype fp32, --bit-exact or --quant int4/int8/mixed (the native kernels)"
    return (f"stagedspec: note: this {dtype} oracle on {weight.device.type} rounds a row by its pass's shape, so "
            f"greedy output can differ from --method ar's at a near-tie; {fixes} keep it ar's")


def warn_amx_bit_exact() -> None:
    """`bit_exact` cannot hold on AMX kernels: say so (the CLI caps the ISA at start-up instead)."""
    if amx_rounds_by_rows():
        print(f"stagedspec: warning: bit_exact on an AMX CPU is not bit-identical unless the process starts "
              f"with ONEDNN_MAX_CPU_ISA={AMX_ISA_CAP} (the CLI's --bit-exact sets it)", file=sys.stderr)
