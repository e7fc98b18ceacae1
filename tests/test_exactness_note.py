"""`generate` says so before a greedy speculative run whose output may differ from `ar`'s (dense bf16), and says
nothing where every method's output is `ar`'s (fp32, the native kernels, bf16 with --bit-exact on a CPU)."""

from __future__ import annotations

import torch

from stagedspec.exactness import greedy_exact, greedy_note
from stagedspec.models.config import ModelConfig
from stagedspec.models.transformer import Transformer


def _model(dtype: torch.dtype) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=128)
    return Transformer(cfg).to(dtype)


def test_fp32_and_bit_exact_bf16_on_a_cpu_say_nothing() -> None:
    assert greedy_exact(_model(torch.float32), bit_exact=False) and greedy_note(_model(torch.float32), False) is None
    assert greedy_note(_model(torch.bfloat16), bit_exact=True) is None


def test_dense_bf16_names_the_fixes_in_one_line() -> None:
    note = greedy_note(_model(torch.bfloat16), bit_exact=False)
    assert note is not None and "\n" not in note
    assert "bfloat16 oracle on cpu" in note and "--dtype fp32" in note and "--bit-exact" in note


def test_bit_exact_is_on_by_default_only_for_a_dense_oracle_on_cuda() -> None:
    """On a CPU the default stays off (the eager bit-exact path costs 10-20%; a GGUF runs the row-exact native
    kernels); tests/test_cuda.py checks that a bf16 model on CUDA gets it."""
    from stagedspec.exactness import default_bit_exact

    assert not default_bit_exact(_model(torch.bfloat16)) and not default_bit_exact(_model(torch.float32))
