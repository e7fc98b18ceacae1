"""The packed weights moved onto 2 MB pages (`stagedspec.kernels.huge_pages`): the same outputs, every holder of a
moved tensor sees the move, and nothing moves where huge pages are unavailable."""

from __future__ import annotations

import mmap

import pytest
import torch

from stagedspec.kernels import huge_pages
from stagedspec.models.config import ModelConfig
from stagedspec.models.quant import quantize_model
from stagedspec.models.transformer import Transformer, init_random


def _tiny_int4() -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=128, norm_eps=1e-5, rope_theta=10000.0,
                      tie_embeddings=True)
    return quantize_model(init_random(Transformer(cfg), seed=3).eval().requires_grad_(False), "int4")


def _logits(model: Transformer) -> torch.Tensor:
    ids = torch.tensor([[5, 9, 33, 2, 200]])
    with torch.inference_mode():
        return model(ids, torch.arange(5), model.new_cache(16))


def _packed(model: Transformer) -> list[torch.Tensor]:
    return [t for t in huge_pages._tensors(model) if t.dtype == torch.uint8]


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) on this platform")
def test_moved_weights_give_the_same_bits_and_every_holder_sees_the_move(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model's layers are a few KB
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    model = _tiny_int4()
    before = _logits(model)
    packed = _packed(model)
    assert packed, "the int4 model has packed weights"
    old = {t.data_ptr() for t in packed}
    moved = huge_pages.move_to_huge_pages(model)
    assert moved >= sum(t.numel() for t in {t.untyped_storage().data_ptr(): t for t in packed}.values())
    # one mapping holds every packed weight, including those the native layer stacks keep in lists of their own
    assert len({t.untyped_storage().data_ptr() for t in _packed(model)}) == 1
    assert not old & {t.data_ptr() for t in _packed(model)}
    assert torch.equal(_logits(model), before)


def test_nothing_moves_where_huge_pages_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    model = _tiny_int4()
    old = [t.data_ptr() for t in _packed(model)]
    assert huge_pages.move_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in _packed(model)] == old


def test_small_storages_stay() -> None:
    """Below `MIN_BYTES` nothing is worth a page of its own."""
    model = _tiny_int4()
    assert huge_pages.move_to_huge_pages(model) == 0


def test_the_arena_starts_on_a_huge_page() -> None:
    arena = huge_pages.huge_page_arena(5000)
    assert arena.numel() == 5000 and arena.data_ptr() % huge_pages.PAGE == 0 and not arena.any()
