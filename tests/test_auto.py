"""`--method auto`, `--dtype auto` and the measured cost profiles behind them.

Choosing an arm is a pure function of (cost curves, acceptance statistics),
so it is tested on synthetic curves: a flat one must pick big trees, a steep
one plain decoding, and a draft that is never accepted must be dropped.
"""

from __future__ import annotations

import json

import pytest
import torch

from stagedspec.auto import (
    Arm,
    AcceptanceStats,
    AutoPolicy,
    ChainStats,
    StepCosts,
    arms_for,
    choose_arm,
    expected_tokens,
    matched_prefix,
    spine,
)
from stagedspec.costs import CostProfile, interpolate, load_or_measure, monotone, profile_path
from stagedspec.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread", "private_cost_cache")

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
FLAT = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{r: 0.0005 for r in (1, 2, 4, 8)}])
STEEP = CostProfile(oracle={r: 0.010 * r for r in ROWS}, drafts=[{r: 0.0005 for r in (1, 2, 4, 8)}])
ARMS = arms_for(has_lookup=True, has_draft=True)
NO_LOOKUP_NOW = {"context": 0, "ngram": 0}


def trained_stats(draft: float, context: float = 0.5, ngram: float = 0.3, steps: int = 200) -> AcceptanceStats:
    """Statistics as if each proposer's chains had been accepted with these per-depth rates."""
    stats = AcceptanceStats()
    g = torch.Generator().manual_seed(0)
    for name, rate in (("draft", draft), ("context", context), ("ngram", ngram)):
        for _ in range(steps):
            matched = 0
            while matched < 8 and float(torch.rand((), generator=g)) < rate:
                matched += 1
            stats.chains[name].record(matched, 8)
    return stats


def test_a_flat_cost_curve_picks_big_trees() -> None:
    arm = choose_arm(ARMS, FLAT, trained_stats(draft=0.7), StepCosts(), NO_LOOKUP_NOW)
    assert arm.kind in ("tree", "staged") and arm.max_nodes >= 8, arm


def test_a_steep_cost_curve_picks_no_speculation() -> None:
    assert choose_arm(ARMS, STEEP, trained_stats(draft=0.7), StepCosts(), {"context": 4, "ngram": 4}) == Arm("ar")


def test_a_draft_that_is_never_accepted_is_dropped() -> None:
    arm = choose_arm(ARMS, FLAT, trained_stats(draft=0.0), StepCosts(), {"context": 6, "ngram": 6})
    assert arm.kind in ("lookup", "ar"), arm
    assert choose_arm(ARMS, FLAT, trained_stats(draft=0.0, context=0.0, ngram=0.0), StepCosts(),
                      {"context": 6, "ngram": 6}) == Arm("ar")


def test_a_lookup_chain_that_does_not_exist_now_is_worth_nothing() -> None:
    stats = trained_stats(draft=0.0, context=0.9, ngram=0.0)
    assert expected_tokens(Arm("lookup", 4), stats, {"context": 0, "ngram": 0}) == 1.0
    assert expected_tokens(Arm("lookup", 4), stats, {"context": 4}) > 3.0
    assert choose_arm(ARMS, FLAT, stats, StepCosts(), {"context": 6}).kind == "lookup"


def test_measured_draft_time_overrides_the_prediction() -> None:
    stats = trained_stats(draft=0.7)
    costs = StepCosts()
    for arm in ARMS:
        if arm.kind in ("tree", "staged"):
            costs.draft_seconds[arm] = 1.0  # drafting turned out to cost 100 oracle passes
    assert choose_arm(ARMS, FLAT, stats, costs, NO_LOOKUP_NOW).kind in ("ar", "lookup")


def test_chain_stats_learn_per_depth_rates_from_a_prior() -> None:
    s = ChainStats(prior=0.5, weight=2.0)
    assert s.rate(0) == pytest.approx(0.5) and s.rate(5) == pytest.approx(0.5)
    for _ in range(50):
        s.record(matched=1, length=4)  # depth 0 always accepted, depth 1 always rejected
    assert s.rate(0) > 0.95 and s.rate(1) < 0.1
    assert s.tries[:3] == [50, 50] and len(s.tries) == 2  # depth 2 was never reached
    reach = s.reach(3)
    assert reach[0] > 0.95 and reach[1] < 0.1 and reach[2] <= reach[1]


def test_arm_calibration_follows_what_the_arm_yielded() -> None:
    stats = AcceptanceStats()
    arm = Arm("tree", 8)
    for _ in range(30):
        stats.observe_arm(arm, predicted_tokens=3.0, tokens=2)  # half the predicted extra tokens
    assert stats.calibration(arm) == pytest.approx(0.5, abs=0.05)


def test_spine_and_matched_prefix() -> None:
    tree = TokenTree([0], [-1])
    a = tree.add(0, 5)
    tree.add(0, 6)
    tree.add(a, 7)
    assert spine(tree) == [5, 7]
    assert matched_prefix([5, 7, 9], [5, 7, 8, 1]) == 2 and matched_prefix([5], []) == 0


def test_arms_depend_on_what_can_propose_and_the_device() -> None:
    assert arms_for(False, False) == [Arm("ar")]
    assert {a.kind for a in arms_for(True, False)} == {"ar", "lookup"}
    assert max(a.size for a in arms_for(False, True, "cuda") if a.kind == "tree") > max(
        a.size for a in arms_for(False, True, "cpu") if a.kind == "tree")


# --- cost profiles -------------------------------------------------------------------------------------------------


def test_interpolation_and_monotone_curves() -> None:
    curve = {1: 1.0, 2: 2.0, 4: 3.0}
    assert interpolate(curve, 3) == pytest.approx(2.5) and interpolate(curve, 6) == pytest.approx(4.0)
    assert interpolate(curve, 0.5) == 1.0
    assert monotone({1: 5.0, 2: 1.0, 4: 3.0}) == {1: 1.0, 2: 1.0, 4: 3.0}  # a slow outlier at 1 row is capped


def test_profiles_are_measured_once_and_cached(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random

    monkeypatch.undo()  # the real cache location, under a temporary $STAGEDSPEC_CACHE
    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=320)
    torch.manual_seed(0)
    oracle = init_random(Transformer(cfg)).eval()
    draft = init_random(Transformer(cfg)).eval()
    first = load_or_measure(oracle, [draft], "cpu")
    assert "measuring pass costs" in capsys.readouterr().err
    path = profile_path(first.key)
    assert path.exists() and set(first.oracle) >= {1, 2, 4} and len(first.drafts) == 1
    again = load_or_measure(oracle, [draft], "cpu")
    assert capsys.readouterr().err == "" and again.oracle == first.oracle  # from the cache, no new line
    assert load_or_measure(oracle, [], "cpu").key != first.key  # other models, other key
    path.write_text("{not json")
    assert load_or_measure(oracle, [draft], "cpu").oracle  # a corrupt entry is measured again
    assert json.loads(path.read_text())["version"] == 2 and "draft_overhead" in json.loads(path.read_text())


# --- dtype auto ----------------------------------------------------------------------------------------------------


def test_dtype_auto_follows_native_bf16(monkeypatch) -> None:  # noqa: ANN001
    from stagedspec import hardware
    from stagedspec.pipeline import resolve_dtype

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert hardware.auto_dtype("cpu")[0] == "bf16"
    assert resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX2")
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "no native bf16" in why
    assert resolve_dtype("auto", "cpu", quant="int4")[0] == torch.bfloat16  # the int4 kernels compute in bf16
    assert resolve_dtype("fp32", "cpu")[0] == torch.float32


def test_the_machine_is_named_and_fingerprinted() -> None:
    from stagedspec import hardware

    assert hardware.describe("cpu") and len(hardware.fingerprint("cpu")) == 16


# --- the pipeline ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):  # noqa: ANN001, ANN201
    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig, truncated_copy

    folder = tmp_path_factory.mktemp("auto") / "tiny"
    save_tiny_hf("llama_gqa", folder)
    model, tok = load_model(folder, dtype=torch.float32)
    flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])  # every arm gets its turn
    pipe = Pipeline.from_loaded(model, tok, [truncated_copy(model, 1)], SpeculationConfig(method="auto"))
    pipe._auto_policy = AutoPolicy(arms_for(True, True), flat)
    ar = Pipeline.from_loaded(model, tok, speculation=SpeculationConfig(method="ar"))
    return pipe, ar


def test_auto_greedy_is_ar_and_seeded_sampling_reproduces(tiny_pipeline) -> None:  # noqa: ANN001
    from stagedspec.sampling import SamplingParams

    pipe, ar = tiny_pipeline
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    for n in (5, 17, 40):
        assert pipe.generate(prompt, max_new_tokens=n).token_ids == ar.generate(prompt, max_new_tokens=n).token_ids
    sampling = SamplingParams(temperature=1.0, top_k=20)
    first = pipe.generate(prompt, max_new_tokens=30, sampling=sampling, seed=7)
    pipe.generate(prompt, max_new_tokens=30, sampling=sampling)  # the shared policy learns more in between
    again = pipe.generate(prompt, max_new_tokens=30, sampling=sampling, seed=7)
    assert again.token_ids == first.token_ids
    assert len(pipe.auto_policy().choices) >= 2 and first.stats.dtype == "fp32"


def test_what_auto_learned_is_kept_for_the_next_process(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A new pipeline on the same machine and models starts from the saved statistics, not the priors."""
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random
    from stagedspec.pipeline import Pipeline, SpeculationConfig, auto_state_path, truncated_copy

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=400)
    model = init_random(Transformer(cfg), seed=3).eval()

    class Tok:  # the little a pipeline needs from a tokenizer when given token ids
        eos_token_ids: list[int] = []

        def decode(self, ids, skip_special_tokens=False):  # noqa: ANN001, ANN202
            return ""

    def pipeline() -> Pipeline:
        return Pipeline.from_loaded(model, Tok(), [truncated_copy(model, 1)], SpeculationConfig(method="auto"))

    first = pipeline()
    first.generate([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=24)
    learned = first.auto_policy().greedy_stats.chains["context"].tries
    assert learned and auto_state_path(first.auto_policy().profile.key).exists()
    second = pipeline()
    assert second.auto_policy().greedy_stats.chains["context"].tries == learned
    assert second.auto_policy().state()["version"] == 1
