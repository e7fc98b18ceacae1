"""fp32 matmul kernels chosen per weight shape and row count (`stagedspec.models.matmul_plan`): the kernel's
arithmetic, the choice and its cache, which models are planned, and that greedy output stays `ar`'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagedspec.models.matmul_plan as mp
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft import DraftModel
from stagedspec.models.quant import quantize_model
from stagedspec.profiling import model_fingerprint
from stagedspec.models.transformer import Transformer, init_random

from _kernel_plans import forced_timings
from _native import native_kernels_unless_no_compiler


def _model(dtype: torch.dtype = torch.float32, tie: bool = True) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=256, norm_eps=1e-5, rope_theta=10000.0,
                      tie_embeddings=tie)
    return init_random(Transformer(cfg), seed=3).to(dtype).eval().requires_grad_(False)


def _measure(wxt_wins: set[int]):  # noqa: ANN202
    """Fake timings: (W x^T)^T is twice as fast at the row counts in `wxt_wins`, equal elsewhere; both cost
    double per measured count (so padding never pays)."""
    calls = []

    def measure(weights, rows):  # noqa: ANN001, ANN202
        calls.append(tuple(weights[0].shape))
        return {n: (2.0 ** i, (0.5 if n in wxt_wins else 1.0) * 2.0 ** i) for i, n in enumerate(rows)}

    return measure, calls


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_wxt_linear_is_x_times_w_transposed(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(48, 40, generator=g), torch.randn(1, rows, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    got = mp.wxt_linear(x, w, b)
    assert got.shape == (1, rows, 48) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    got.view(rows, 48)  # the layers view their outputs: it must be contiguous


def test_the_plan_covers_every_row_count_padded_to_the_next_measured_one() -> None:
    plan = mp.expand_plan({1: (True, 2), 2: (False, 2), 4: (True, 4), 8: (False, 8)})
    assert plan == ((False, 0), (True, 2), (False, 2), (True, 4), (True, 4), (False, 8), (False, 8), (False, 8),
                    (False, 8))
    assert mp.expand_plan({2: (False, 2), 4: (False, 4)})[3] == (False, 4)  # unmeasured: padded to a timed shape


def test_the_choice_is_the_fastest_kernel_and_row_count_by_a_margin() -> None:
    assert mp.choose({1: (1.0, 0.89), 2: (1.0, 0.91), 4: (1.2, 1.2)}) == {1: (True, 1), 2: (False, 2),
                                                                          4: (False, 4)}
    # AVX2 EPYC, 2026-11-24 (ms, the oracle's matmuls): one row runs padded to two, 3 rows as 4
    timed = {1: (37.8, 60.0), 2: (69.0, 28.8), 3: (86.8, 36.8), 4: (73.9, 29.1), 6: (69.2, 43.6)}
    assert mp.choose(timed) == {1: (True, 2), 2: (True, 2), 3: (True, 4), 4: (True, 4), 6: (True, 6)}
    # padding within the noise margin of the unpadded F.linear is not taken
    assert mp.choose({3: (1.0, 1.5), 4: (0.95, 2.0)}) == {3: (False, 3), 4: (False, 4)}


@pytest.mark.parametrize("kind", ["F.linear", "wxt"])
@pytest.mark.parametrize("rows, run_rows", [(1, 2), (3, 4), (5, 8), (13, 16)])
def test_a_padded_product_is_the_unpadded_one(kind: str, rows: int, run_rows: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(48, 40, generator=g), torch.randn(48, generator=g), torch.randn(1, rows, 40, generator=g)
    plan = tuple((kind == "wxt", max(n, run_rows if n == rows else n)) for n in range(rows + 1))
    seen = []
    real = mp.wxt_linear
    monkeypatch.setattr(mp, "wxt_linear", lambda a, *r: seen.append(a.shape[-2]) or real(a, *r))
    got = mp.planned_linear(x, w, b, plan)
    assert got.shape == (1, rows, 48) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert seen == ([run_rows] if kind == "wxt" else [])


def test_planned_layers_run_the_chosen_kernel_per_row_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = _model()
    measure, calls = _measure({2, 3})
    mp.plan_matmuls(model, measure=measure, cache_file=tmp_path / "plan.json")
    up = model.layers[0].mlp.w_up
    assert isinstance(up, mp.PlannedLinear) and isinstance(up, nn.Linear)
    assert up.row_plan[:5] == ((False, 0), (False, 1), (True, 2), (True, 3), (False, 4))
    assert model.runtime.head_row_plan is not None and model.runtime.head_row_plan[2] == (True, 2)
    used = []
    real = mp.wxt_linear
    monkeypatch.setattr(mp, "wxt_linear", lambda *a: used.append(a[0].shape[-2]) or real(*a))
    x = torch.randn(1, 3, 64)
    torch.testing.assert_close(up(x), F.linear(x, up.weight, up.bias), rtol=1e-5, atol=1e-5)
    up(torch.randn(1, 1, 64))
    up(torch.randn(1, 100, 64))  # beyond the plan: F.linear
    assert used == [3]


def test_timings_are_cached_per_shape_count_and_machine(tmp_path: Path) -> None:
    cache = tmp_path / "plan.json"
    measure, calls = _measure({1})
    mp.plan_matmuls(_model(), measure=measure, cache_file=cache)
    shapes = set(calls)
    # tied head (320x64), fused qkv, o, gate/up, down
    assert (320, 64) in shapes and len(calls) == len(shapes) == 5
    data = json.loads(cache.read_text())
    assert all(k.startswith(mp.FORMAT + "|") and set(v) == {"plan", "linear_ms", "wxt_ms"} for k, v in data.items())
    again, calls2 = _measure(set())
    model = mp.plan_matmuls(_model(), measure=again, cache_file=cache)
    assert calls2 == [] and model.layers[1].attn.wqkv.row_plan[1] == (True, 1)  # from the cache
    key = next(iter(data))
    for bad in ({"wxt_rows": [1, 2]}, {"plan": {"3": [True, 2]}}, {"plan": {"x": [True, 2]}}, {"plan": {}}):
        cache.write_text(json.dumps({**data, key: bad}))  # an old format or a damaged entry: that shape re-timed
        calls2.clear()
        mp.plan_matmuls(_model(), measure=again, cache_file=cache)
        assert len(calls2) == 1
    cache.write_text("{not json")
    calls2.clear()
    mp.plan_matmuls(_model(), measure=again, cache_file=cache)  # unreadable: timed again
    assert len(calls2) == 5
    mp.forget_measured_plans(cache)
    assert not cache.exists()


def test_the_plan_is_part_of_the_cost_profile_key(tmp_path: Path) -> None:
    plain = _model()
    a = mp.plan_matmuls(_model(), measure=_measure({1})[0], cache_file=tmp_path / "a.json")
    b = mp.plan_matmuls(_model(), measure=_measure({2})[0], cache_file=tmp_path / "b.json")
    assert len({model_fingerprint(plain), model_fingerprint(a), model_fingerprint(b)}) == 3


def test_the_native_path_is_part_of_the_cost_profile_key() -> None:
    """The 256-bit VNNI tiles and their 512-bit pairs (or AVX2 and VNNI) cost differently by rows on one CPU, so
    a profile measured on one path is not read back for the other."""
    best = native_kernels_unless_no_compiler()
    if best is None or best.isa < 2:
        pytest.skip("needs two native paths with int8 instructions (AVX2 and AVX-512 VNNI)")
    prints = {model_fingerprint(quantize_model(_model(), "int4", kernels=best.with_isa(isa))) for isa in (1, 2)}
    assert len(prints) == 2


def test_only_fp32_cpu_models_are_planned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    measure, calls = _measure({1})
    bf16 = mp.plan_matmuls(_model(torch.bfloat16), measure=measure, cache_file=tmp_path / "p.json")
    assert calls == [] and type(bf16.layers[0].mlp.w_up) is nn.Linear and bf16.runtime.head_row_plan is None
    monkeypatch.setenv(mp.OFF_ENV, "off")
    off = mp.plan_matmuls(_model(), measure=measure, cache_file=tmp_path / "p.json")
    assert calls == [] and type(off.layers[0].mlp.w_up) is nn.Linear


def test_a_quantised_head_is_left_to_its_kernel(tmp_path: Path) -> None:
    from stagedspec.models.quant import Int8Linear

    model = _model()
    model.head_q = Int8Linear(model.head_weight.detach(), None)
    measure, calls = _measure({1})
    mp.plan_matmuls(model, measure=measure, cache_file=tmp_path / "p.json")
    assert (320, 64) not in calls and model.runtime.head_row_plan is None


def test_an_untied_head_and_a_drafts_own_head_are_planned_as_heads(tmp_path: Path) -> None:
    untied = mp.plan_matmuls(_model(tie=False), measure=_measure({1})[0], cache_file=tmp_path / "p.json")
    assert type(untied.lm_head) is nn.Linear and untied.runtime.head_row_plan is not None  # `head_logits` multiplies it
    draft = DraftModel(_model(), layers=[0], head_tokens=torch.arange(100), dtype=torch.float32).eval()
    measure, calls = _measure({1})
    mp.plan_matmuls(draft, measure=measure, cache_file=tmp_path / "p.json")
    assert (100, 64) in calls and draft.runtime.head_row_plan is not None and type(draft.head) is nn.Linear
    assert mp.describe(draft)[-1].endswith("(output head)")


def test_a_layers_draft_keeps_the_oracles_plan(tmp_path: Path) -> None:
    from stagedspec.models.draft_formats import truncated_copy

    oracle = mp.plan_matmuls(_model(), measure=_measure({1, 2})[0], cache_file=tmp_path / "p.json")
    draft = truncated_copy(oracle, 2)
    assert draft.runtime.head_row_plan == oracle.runtime.head_row_plan
    assert draft.runtime.matmul_plan_signature == oracle.runtime.matmul_plan_signature
    assert draft.layers[0].mlp.w_up is oracle.layers[0].mlp.w_up


def test_the_forced_plans_cover_every_kind_of_step() -> None:
    mixed = set(mp.choose(forced_timings("mixed")(None, mp.PLAN_ROWS)).items())
    assert {(wxt, m > n) for n, (wxt, m) in mixed} == {(False, False), (True, False), (True, True), (False, True)}
    assert all(wxt and m == n for n, (wxt, m) in mp.choose(forced_timings("all")(None, mp.PLAN_ROWS)).items())


@pytest.mark.parametrize("plan", ["all", "mixed"])
@pytest.mark.parametrize("kw", [
    dict(method="tree", tree_budget=6, tree_depth=3, tree_branching=2),
    dict(method="staged", ngram=None, stage_length=3, lookup_length=3),
])
def test_greedy_output_with_planned_kernels_is_ar(plan: str, kw: dict, tmp_path: Path) -> None:
    """Tiny fp32 oracle and draft, both planned: every method's greedy tokens are `ar`'s."""
    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    save_tiny_hf("llama_gqa", tmp_path / "tiny")
    oracle, tok = load_model(tmp_path / "tiny", dtype=torch.float32, plan_kernels=False)
    measure = forced_timings(plan)
    mp.plan_matmuls(oracle, measure=measure, cache_file=tmp_path / "p.json")
    draft = DraftModel(oracle, layers=[0], head_tokens=torch.arange(200), dtype=torch.float32).eval()
    mp.plan_matmuls(draft, measure=measure, cache_file=tmp_path / "p.json")
    ar = Pipeline(oracle, tok, speculation=SpeculationConfig(method="ar"))
    pipe = Pipeline(oracle, tok, [draft], SpeculationConfig(**kw))
    for prompt in ([1, 5, 9, 33, 2, 200, 17], [1, 40, 41, 42, 40, 41, 42, 40]):
        want = ar.generate(prompt, max_new_tokens=30).token_ids
        assert pipe.generate(prompt, max_new_tokens=30).token_ids == want
