"""A draft's weight format (`stagedspec.draft_weights`): auto's measured choice, its cache, the rules and errors,
and that greedy output does not depend on it (bit-exact against `ar`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagedspec.draft_weights import (check_draft_weights, choose_draft_weights, forget_measured_choices,
                                      split_weights_suffix)
from stagedspec.errors import StagedSpecError
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft import DraftModel
from stagedspec.models.quant import Int8Linear, RowSwitchLinear
from stagedspec.models.transformer import Transformer, init_random


def _oracle(dtype: torch.dtype = torch.bfloat16) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=256, norm_eps=1e-5, rope_theta=10000.0,
                      tie_embeddings=True)
    return init_random(Transformer(cfg), seed=3).to(dtype).eval().requires_grad_(False)


def _draft_loader(oracle: Transformer):  # noqa: ANN202
    calls = []

    def load() -> DraftModel:
        calls.append(1)
        return DraftModel(oracle, layers=[0, 2], head_tokens=torch.arange(200), dtype=oracle.embed.weight.dtype
                          ).eval().requires_grad_(False)

    return load, calls


def _fake_measure(int8_ms: dict[int, float], native_ms: float):  # noqa: ANN202
    """Timings by format and rows: a draft is int8 once its head is an `Int8Linear`."""
    def measure(model: Transformer) -> dict[int, float]:
        if isinstance(model.head_q, Int8Linear):
            return {r: ms / 1e3 for r, ms in int8_ms.items()}
        return {r: native_ms / 1e3 for r in int8_ms}

    return measure


def _is_int8(draft: Transformer) -> bool:
    return isinstance(draft.layers[0].mlp.w_up, Int8Linear) and isinstance(draft.head_q, Int8Linear)


def _int8_rows(draft: Transformer) -> int | None:
    """The row limit of a row-switching draft (None: not one)."""
    up, head = draft.layers[0].mlp.w_up, draft.head_q
    if isinstance(up, RowSwitchLinear) and isinstance(head, RowSwitchLinear):
        assert up.max_rows == head.max_rows
        return up.max_rows
    return None


def test_spec_suffix_names_a_format() -> None:
    assert split_weights_suffix("default@int8") == ("default", "int8")
    assert split_weights_suffix("/d/draft@native") == ("/d/draft", "native")
    assert split_weights_suffix("/d/draft") == ("/d/draft", None)
    assert split_weights_suffix("/d/x@y") == ("/d/x@y", None)  # not a format: part of the path
    assert split_weights_suffix("@int8") == ("@int8", None)


def test_bad_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import stagedspec.draft_weights as draft_weights

    with pytest.raises(StagedSpecError, match="unknown --draft-weights 'int3'"):
        check_draft_weights("int3", torch.bfloat16, "cpu")
    with pytest.raises(StagedSpecError, match="native CPU kernels only"):
        check_draft_weights("mixed", torch.float32, "cuda")
    monkeypatch.setattr(draft_weights, "native_kernels", lambda quiet=False: None)
    with pytest.raises(StagedSpecError, match="computes in bf16"):
        check_draft_weights("int8", torch.float32, "cpu")
    with pytest.raises(StagedSpecError, match="CPU kernels only"):
        check_draft_weights("int8", torch.bfloat16, "cuda")
    check_draft_weights("auto", torch.float32, "cuda")  # auto and native are always valid


def test_auto_runs_int8_up_to_the_rows_it_was_measured_faster_at_and_caches_that(tmp_path: Path) -> None:
    oracle = _oracle()
    load, calls = _draft_loader(oracle)
    cache = tmp_path / "draft-weights.json"
    timed = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.0, 16: 3.0}  # against 2.0 ms native at every row count
    draft = choose_draft_weights(load, oracle, "auto", measure=_fake_measure(timed, 2.0), cache_file=cache,
                                 quiet=True)
    assert _int8_rows(draft) == 4 and draft.runtime.weight_format == "int8" and "up to 4 rows" in draft.runtime.weight_reason
    assert len(calls) == 2  # the timed copy lost its dense weights: a fresh one switches by rows
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["int8_max_rows"] == 4 and entry["native_ms"]["8"] == 2.0 and entry["int8_ms"]["1"] == 1.0

    def no_timing(model: Transformer) -> dict[int, float]:
        raise AssertionError("a cached choice is not measured again")

    again = choose_draft_weights(load, oracle, "auto", measure=no_timing, cache_file=cache, quiet=True)
    assert _int8_rows(again) == 4 and len(calls) == 3
    forget_measured_choices(cache)
    assert not cache.exists()


def test_auto_keeps_native_weights_when_int8_is_not_clearly_faster(tmp_path: Path) -> None:
    oracle = _oracle()
    load, _ = _draft_loader(oracle)
    draft = choose_draft_weights(load, oracle, "auto", measure=_fake_measure({1: 1.95, 4: 1.0}, 2.0),
                                 cache_file=tmp_path / "c.json", quiet=True)
    assert draft.runtime.weight_format == "native" and draft.head_q is None and _int8_rows(draft) is None
    assert isinstance(draft.layers[0].mlp.w_up, torch.nn.Linear)


def test_a_row_switching_layer_is_int8_up_to_its_rows_and_dense_above() -> None:
    w = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    layer = RowSwitchLinear(w, None, max_rows=4)
    for rows in (1, 4, 5, 16):
        x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
        want = layer.q(x) if rows <= 4 else torch.nn.functional.linear(x, w)
        assert torch.equal(layer(x), want)
    assert not any(t is layer.dense_weight for t in layer.buffers())  # not counted as streamed


def test_rules_without_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stagedspec.draft_weights as draft_weights

    monkeypatch.setattr(draft_weights, "native_kernels", lambda quiet=False: None)  # int8 in fp32 needs them
    never = _fake_measure({1: float("nan")}, float("nan"))
    cache = tmp_path / "c.json"
    # fp32 (the reference dtype): no int8 kernel applies
    oracle32 = _oracle(torch.float32)
    load, _ = _draft_loader(oracle32)
    assert choose_draft_weights(load, oracle32, "auto", measure=never, cache_file=cache).runtime.weight_format == "native"
    with pytest.raises(StagedSpecError, match="computes in bf16"):
        choose_draft_weights(load, oracle32, "int8", cache_file=cache)
    # asked for, on bf16: int8 without timing anything
    oracle = _oracle()
    load, _ = _draft_loader(oracle)
    assert _is_int8(choose_draft_weights(load, oracle, "int8", measure=never, cache_file=cache))
    assert choose_draft_weights(load, oracle, "native", measure=never, cache_file=cache).head_q is None
    assert not cache.exists()


def test_a_layers_draft_never_quantises_the_oracles_own_layers(tmp_path: Path) -> None:
    from stagedspec.models.draft_formats import truncated_copy

    oracle = _oracle()
    draft = choose_draft_weights(lambda: truncated_copy(oracle, 1), oracle, "auto", cache_file=tmp_path / "c.json")
    assert draft.runtime.weight_format == "native" and not isinstance(oracle.layers[0].mlp.w_up, Int8Linear)
    with pytest.raises(StagedSpecError, match="oracle's own layers"):
        choose_draft_weights(lambda: truncated_copy(oracle, 1), oracle, "int8")
    assert not isinstance(oracle.layers[0].mlp.w_up, Int8Linear)


def test_a_feature_draft_stays_native_under_auto_and_runs_int8_when_asked() -> None:
    from stagedspec.models.feature_draft import FeatureDraftModel

    oracle = _oracle()

    def load() -> FeatureDraftModel:
        return FeatureDraftModel(oracle, layers=[2], head_tokens=torch.arange(200), dtype=torch.bfloat16).eval()

    assert choose_draft_weights(load, oracle, "auto").runtime.weight_format == "native"
    draft = choose_draft_weights(load, oracle, "int8")
    assert draft.runtime.weight_format == "int8" and isinstance(draft.layers[0].mlp.w_up, Int8Linear)


@pytest.mark.parametrize("kw", [
    dict(method="tree", tree_budget=6, tree_depth=3, tree_branching=2),
    dict(method="staged", ngram=None, stage_length=3, lookup_length=3),
])
@pytest.mark.parametrize("max_rows", [None, 2])
def test_greedy_output_with_an_int8_draft_is_ar_bit_for_bit(kw: dict, max_rows: int | None, tmp_path: Path) -> None:
    """bf16 oracle, int8 draft (always, or up to 2 rows): with `bit_exact` every method's tokens are `ar`'s."""
    from stagedspec.draft_weights import to_int8

    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    save_tiny_hf("llama_gqa", tmp_path / "tiny")
    oracle, tok = load_model(tmp_path / "tiny", dtype=torch.bfloat16)

    def load() -> DraftModel:
        return DraftModel(oracle, layers=[0], head_tokens=torch.arange(200), dtype=torch.bfloat16).eval()

    draft = to_int8(load(), oracle, max_rows)
    assert _is_int8(draft) if max_rows is None else _int8_rows(draft) == 2
    ar = Pipeline(oracle, tok, speculation=SpeculationConfig(method="ar"))
    pipe = Pipeline(oracle, tok, [draft], SpeculationConfig(**kw))
    ar.bit_exact = pipe.bit_exact = True
    for prompt in ([1, 5, 9, 33, 2, 200, 17], [1, 40, 41, 42, 40, 41, 42, 40]):
        want = ar.generate(prompt, max_new_tokens=30).token_ids
        assert pipe.generate(prompt, max_new_tokens=30).token_ids == want


@pytest.mark.real_model
def test_cli_staged_with_an_int8_draft_on_bf16_is_ar(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job's command with `--draft-weights int8` on the bf16 oracle: the same tokens as `ar`; in fp32
    without the native kernels (PyTorch's int8 kernel computes in bf16), a one-line refusal."""
    import stagedspec.draft_weights as draft_weights
    from stagedspec.cli import main

    common = ["generate", "Write a function that reverses a string.", "--chat", "--dtype", "bf16", "--bit-exact",
              "--max-new-tokens", "24", "--json"]
    assert main([*common, "--method", "staged", "--draft", "default", "--draft-weights", "int8"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert staged["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) > 0
    monkeypatch.setattr(draft_weights, "native_kernels", lambda quiet=False: None)
    assert main([*common, "--method", "staged", "--draft", "default", "--draft-weights", "int8", "--dtype",
                 "fp32"]) == 2
    assert "--draft-weights int8 computes in bf16" in capsys.readouterr().err


def test_the_server_keeps_native_draft_weights_unless_the_oracle_is_quantised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its batched passes run the drafts over many rows, where the int8 kernel loses (and ragged passes need
    dense weights)."""
    from stagedspec.pipeline import SpeculationConfig
    from stagedspec.server import engine

    seen = []

    class FakeModelSet:
        def __init__(self) -> None:
            self.model = self.tokenizer = self.ngram = None
            self.draft_models = ()

        @classmethod
        def load(cls, *args, draft_weights: str, **kwargs) -> FakeModelSet:  # noqa: ANN002, ANN003
            seen.append(draft_weights)
            return cls()

    monkeypatch.setattr(engine, "ModelSet", FakeModelSet)
    spec = SpeculationConfig(method="tree")
    engine.Engine.load("default", ["default"], spec, quant="none")
    engine.Engine.load("default", ["default"], spec, quant="int4")
    engine.Engine.load("default", ["default"], spec, quant="none", draft_weights="int8")
    assert seen == ["native", "auto", "int8"]


def test_a_quantised_gguf_draft_under_a_quantised_oracle_runs_its_own_formats_or_int8_as_measured(
        tmp_path: Path) -> None:
    """With a loader of the draft in its GGUF's own formats, auto times those and int8 once (cached) and runs
    the faster at 1-4 rows; `mixed` asks for them, and is refused where the draft has no such source."""
    from stagedspec.models.quant import quantize_model

    cfg = _oracle().config
    oracle = quantize_model(init_random(Transformer(cfg), seed=3).eval().requires_grad_(False), "int4")

    def load() -> Transformer:
        return init_random(Transformer(cfg), seed=4).eval().requires_grad_(False)

    def load_mixed() -> Transformer:
        model = quantize_model(load(), "int8")
        model.from_source = True  # stands for the GGUF's own formats here
        return model

    def measure(mixed_ms: float, int8_ms: float):  # noqa: ANN202
        return lambda m: {r: (mixed_ms if getattr(m, "from_source", False) else int8_ms) / 1e3 for r in (1, 2, 4, 8)}

    def no_timing(model: Transformer) -> dict[int, float]:
        raise AssertionError("a cached choice is not measured again")

    cache = tmp_path / "c.json"
    draft = choose_draft_weights(load, oracle, "auto", measure=measure(1.0, 2.0), cache_file=cache, quiet=True,
                                 load_mixed=load_mixed)
    assert draft.runtime.weight_format == "mixed" and draft.from_source and "faster here than int8" in draft.runtime.weight_reason
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["choice"] == "mixed" and entry["int8_ms"]["4"] == 2.0
    again = choose_draft_weights(load, oracle, "auto", measure=no_timing, cache_file=cache, quiet=True,
                                 load_mixed=load_mixed)
    assert again.runtime.weight_format == "mixed" and again.from_source

    other = tmp_path / "other.json"
    slower = choose_draft_weights(load, oracle, "auto", measure=measure(3.0, 2.0), cache_file=other, quiet=True,
                                  load_mixed=load_mixed)
    assert slower.runtime.weight_format == "int8" and _is_int8(slower) and not getattr(slower, "from_source", False)
    cached = choose_draft_weights(load, oracle, "auto", measure=no_timing, cache_file=other, quiet=True,
                                  load_mixed=load_mixed)
    assert cached.runtime.weight_format == "int8" and _is_int8(cached)

    asked = choose_draft_weights(load, oracle, "mixed", measure=no_timing, cache_file=cache, load_mixed=load_mixed)
    assert asked.runtime.weight_format == "mixed" and asked.from_source
    with pytest.raises(StagedSpecError, match="needs a draft GGUF with quantised weights"):
        choose_draft_weights(load, oracle, "mixed", measure=no_timing, cache_file=cache)


def test_a_draft_under_a_quantised_oracle_times_no_fp32_kernels_unless_it_stays_fp32(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its fp32 kernels would be timed for nothing: the draft is quantised too (for a 0.5B draft on two cores
    that timing took 100 s).  Asked to stay native, it runs the planned fp32 kernels as under an fp32 oracle."""
    import stagedspec.models.matmul_plan as matmul_plan
    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import load_draft_model

    from _tiny_models import save_tiny_hf

    folder = tmp_path / "tiny"
    save_tiny_hf("llama_gqa", folder)
    oracle, tok = load_model(folder, dtype=torch.float32, quant="int8")
    planned = []
    real_apply = matmul_plan.apply_plan

    def apply_plan(model, plans) -> None:  # noqa: ANN001
        planned.append(model)
        real_apply(model, plans)

    monkeypatch.setattr(matmul_plan, "apply_plan", apply_plan)
    draft = load_draft_model(str(folder), oracle, tok, torch.float32, "cpu")
    assert draft.runtime.weight_format == "int8" and planned == []
    native = load_draft_model(str(folder), oracle, tok, torch.float32, "cpu", weights="native")
    assert native.runtime.weight_format == "native" and planned == [native]
    assert any(isinstance(m, matmul_plan.PlannedLinear) for m in native.modules())
