"""The draft-format registry (`models.draft_formats`): which format reads a `--draft` spec, and the layering
that keeps the draft folder's kinds from importing each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagedspec.errors import StagedSpecError
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft_formats import FORMATS, DraftSource, draft_format, load_draft_spec
from stagedspec.models.transformer import Transformer, init_random
from tests.test_import_graph import import_graph


def test_each_spec_is_read_by_the_first_format_that_takes_it(tmp_path: Path) -> None:
    (tmp_path / "draft_config.json").write_text("{}")
    assert [f.name for f in FORMATS] == ["layers", "folder", "checkpoint"]
    assert draft_format("layers:2").name == "layers"
    assert draft_format("default").name == "folder"
    assert draft_format(str(tmp_path)).name == "folder"
    assert draft_format(str(tmp_path / "model.gguf")).name == "checkpoint"  # anything else: a model checkpoint
    assert draft_format("smollm2-135m").name == "checkpoint"


def test_the_layers_format_shares_the_oracle_s_first_layers() -> None:
    cfg = ModelConfig(arch="llama", vocab_size=24, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=64)
    oracle = init_random(Transformer(cfg), seed=0, std=0.3).eval()
    source = DraftSource(oracle, tokenizer=None, dtype=torch.float32, device="cpu")
    draft = load_draft_spec("layers:1", source)
    assert draft.config.n_layers == 1 and draft.embed.weight is oracle.embed.weight
    with pytest.raises(StagedSpecError, match="expected layers:N"):
        load_draft_spec("layers:x", source)
    with pytest.raises(StagedSpecError, match="1..2 layers"):
        load_draft_spec("layers:3", source)


def test_a_draft_model_never_imports_its_loaders_or_the_kind_built_on_it() -> None:
    """`feature_draft` subclasses `draft`; the loaders that tell the kinds apart sit above both."""
    graph = import_graph()
    above = {"stagedspec.models.feature_draft", "stagedspec.models.draft_loading", "stagedspec.models.draft_formats"}
    assert not graph["stagedspec.models.draft"] & above
    assert not graph["stagedspec.models.feature_draft"] & (above - {"stagedspec.models.feature_draft"})
