"""Activation dtypes by name (`--dtype auto|bf16|fp32`), and what `auto` resolves to on this machine."""

from __future__ import annotations

import torch

from stagedspec.errors import StagedSpecError
from stagedspec.hardware import auto_dtype
from stagedspec.kernels.native import native_kernels

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return resolve_dtype(name, "cpu")[0]
    try:
        return DTYPES[name]
    except KeyError:
        raise StagedSpecError(f"unknown dtype {name!r}: use auto, bf16 or fp32") from None


def resolve_dtype(name: str, device: str, quant: str = "none") -> tuple[torch.dtype, str]:
    """(dtype, why) for a --dtype value; `auto` asks the hardware (`stagedspec.hardware.auto_dtype`).

    Quantised weights on the native kernels take either dtype (activations are
    quantised to int8 inside them), so `auto` asks the hardware for the rest
    of the pass too; PyTorch's fallback kernels compute in bf16 only.
    """
    if name != "auto":
        return parse_dtype(name), "as asked"
    if quant != "none":
        if native_kernels() is None:
            return torch.bfloat16, f"--quant {quant} on PyTorch's kernels computes in bf16"
    chosen, why = auto_dtype(device)
    return DTYPES[chosen], why


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


def parse_weights(name: str) -> tuple[torch.dtype, str]:
    """A weight format as the engine benchmarks name it: bf16, fp32, or int4/int8 (quantised, bf16 compute)."""
    if name in ("int4", "int8"):
        return torch.bfloat16, name
    try:
        return DTYPES[name], "none"
    except KeyError:
        raise StagedSpecError(f"unknown weight format {name!r}: use bf16, fp32, int8 or int4") from None
