"""`stagedspec distill` / `stagedspec eval-draft` end to end on a tiny random oracle (a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _tiny_models import save_tiny_hf
from stagedspec import cli
from stagedspec.cli.distill import documented_functions, order_streams, sample_requests
from stagedspec.models.draft import CONFIG_NAME, WEIGHTS_NAME
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.loading import load_model

CODE = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(values, factor=2):
    """Multiply every value by factor."""
    out = []
    for v in values:
        out.append(v * factor)
    return out


def clamp(x, lo, hi):
    """Clamp x into [lo, hi].

    >>> clamp(5, 0, 3)
    3
    """
    return max(lo, min(x, hi))


class Box:
    def size(self):
        """How many items the box holds."""
        return len(self.items)
'''


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-oracle")
    save_tiny_hf("llama_gqa", folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("corpus")
    code = folder / "mod.py"
    code.write_text(CODE * 4)
    text = folder / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return [str(code), str(text)]


def run(argv: list[str]) -> int:
    """`stagedspec.cli.main`: the main parser registers the distill commands (`cli.distill.add_commands`)."""
    return cli.main(argv)


def distill_args(oracle_dir: Path, corpus: list[str], out: Path, *extra: str) -> list[str]:
    return ["distill", "--oracle", str(oracle_dir), "--out", str(out), "--corpus", *corpus, "--layers", "1",
            "--vocab-top", "64", "--seq-len", "32", "--batch-size", "2", "--tokens", str(4 * 64),
            "--eval-every", "2", "--checkpoint-every", "2", "--dtype", "fp32", "--no-progress", *extra]


def test_distill_produces_loadable_draft_and_eval_reports(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "draft", tmp_path / "work"
    rc = run(distill_args(oracle_dir, corpus, out, "--work-dir", str(work), "--chat-wrap", "1.0",
                          "--oracle-samples", "2", "--sample-tokens", "4", "--sample-repeat", "2",
                          "--sample-batch", "2"))
    assert rc == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {CONFIG_NAME, WEIGHTS_NAME}  # checkpoints stay in --work-dir
    assert (work / "checkpoint.pt").is_file() and (work / "metrics.json").is_file()
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["training"]["complete"] is True and cfg["training"]["steps_done"] == 4
    assert cfg["training"]["corpus"]["chat_exchanges"] == 4 * 4 and cfg["training"]["corpus"]["oracle_samples"] == 2
    oracle, tok = load_model(str(oracle_dir), dtype=torch.float32)
    from stagedspec.tokenizer import tokenizer_fingerprint

    draft = load_draft(out, oracle, expected_fingerprint=tokenizer_fingerprint(tok))
    assert draft.head_weight.shape[0] == 64

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\n\ndef g(a, b):\n")
    capsys.readouterr()
    rc = run(["eval-draft", "--oracle", str(oracle_dir), "--draft", str(out), "--prompts", str(prompts),
              "--tokens", "6", "--accept-prompts", "1", "--accept-tokens", "6", "--dtype", "fp32", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("top1", "top2", "top4", "top8", "draft_cost_ratio", "chain_mean_accepted_length",
                "tree_mean_accepted_length"):
        assert key in report
    assert report["positions"] > 0 and 0 <= report["top1"] <= report["top4"] <= report["top8"] <= 1
    assert report["chain_mean_accepted_length"] >= 1 and report["tree_mean_accepted_length"] >= 1

    rc = run(["eval-draft", "--oracle", str(oracle_dir), "--draft", str(out), "--prompts", str(prompts),
              "--tokens", "6", "--accept-prompts", "0", "--dtype", "fp32"])
    text = capsys.readouterr().out
    assert rc == 0 and "top-1 agreement" in text and "top-4 coverage" in text and "cost per token" in text

    # Continued training: a second run starts from this draft (its head and layers) on the same corpus.
    more = tmp_path / "more"
    rc = run(distill_args(oracle_dir, corpus, more, "--init-from", str(out), "--lr", "1e-4"))
    assert rc == 0, capsys.readouterr().err
    cfg2 = json.loads((more / CONFIG_NAME).read_text())
    assert cfg2["training"]["config"]["init_from"] == str(out) and cfg2["oracle_layers"] == cfg["oracle_layers"]
    first_kl = cfg["training"]["history"][-1]["heldout_kl"]
    assert cfg2["training"]["history"][0]["heldout_kl"] < 0.2 * cfg["training"]["history"][0]["heldout_kl"] + first_kl
    assert run(distill_args(oracle_dir, corpus, tmp_path / "x", "--init-from", str(tmp_path))) == 2
    assert "not a draft folder" in capsys.readouterr().err


def test_time_box_saves_partial_draft_and_resume_finishes(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, corpus, out, "--max-minutes", "1e-9")) == 0
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["training"]["complete"] is False and cfg["training"]["steps_done"] == 1
    assert "--resume" in capsys.readouterr().out
    assert run(distill_args(oracle_dir, corpus, out, "--resume", "--stop-after-steps", "2")) == 0
    assert json.loads((out / CONFIG_NAME).read_text())["training"]["steps_done"] == 2
    assert run(distill_args(oracle_dir, corpus, out, "--resume")) == 0
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["training"]["complete"] is True and cfg["training"]["steps_done"] == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--corpus", "/nonexistent/corpus.py"], "corpus file not found"),
        (["--layers", "3"], "the oracle has only 2 layers"),
        (["--resume"], "nothing to resume"),
        (["--feature-taps", "1"], "--feature-taps applies to --kind feature only"),
        (["--kind", "feature", "--feature-taps", "2"], "feature taps must be distinct layers in 1..1"),
    ],
)
def test_bad_inputs_are_one_line_errors(oracle_dir: Path, corpus: list[str], tmp_path: Path, extra: list[str],
                                        message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()  # a first use may say it times the fp32 kernels first
    assert err[-1].startswith("stagedspec: error:") and message in err[-1]


def test_argument_validation(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """Bad flag values are argparse's errors: exit status 2 and one line (`cli.commands.OneLineErrorParser`)."""
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--layers", "0")) == 2
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--chat-wrap", "1.5")) == 2
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--feature-taps", "2,x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("error:" in line for line in err)


def test_humaneval_is_refused(oracle_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "HumanEval.jsonl"
    bad.write_text('{"prompt": "def f():"}\n')
    assert run(distill_args(oracle_dir, [str(bad)], tmp_path / "d")) == 2
    assert "HumanEval must never be used" in capsys.readouterr().err


def test_documented_functions_and_stream_order() -> None:
    found = documented_functions(CODE)
    assert [r.splitlines()[0] for r, _ in found] == ["def add(a, b):", "def scale(values, factor=2):", "def clamp(x, lo, hi):",
                                                  "def size(self):"]
    request, full = found[3]
    assert request == 'def size(self):\n    """How many items the box holds."""\n' and full.endswith("return len(self.items)\n")
    streams = [[i] * 100 for i in range(400)]
    repeats = {i: 3 for i in range(400)}
    ordered = order_streams(streams, repeats, 0.02, seed=0)
    counts = [sum(1 for s in ordered if s == streams[i]) for i in range(400)]
    assert set(counts) == {1, 3}  # held-out (tail) streams are never repeated into training
    assert all(counts[s[0]] == 1 for s in ordered[-30:])


def test_sample_requests_are_chat_requests_or_raw_code_for_a_base_model(tmp_path: Path) -> None:
    """A chat model is asked as the bench asks it; a base model (no chat template) gets the signature and
    docstring as they are, the raw prompt the bench gives it."""
    src = tmp_path / "mod.py"
    src.write_text(CODE)
    chat = sample_requests([src], 10, seed=0)
    raw = sample_requests([src], 10, seed=0, chat=False)
    assert chat and len(chat) == len(raw)
    assert all(r.startswith("Complete the following Python function.") for r in chat)
    assert all(r.lstrip().startswith("def ") and '"""' in r and "Complete" not in r for r in raw)


def test_device_cpu_is_recorded_and_cuda_without_a_gpu_is_a_one_line_error(
        oracle_dir: Path, corpus: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, corpus, out, "--device", "cpu", "--oracle-samples", "2",
                            "--sample-tokens", "3")) == 0  # --sample-batch defaults for the CPU
    training = json.loads((out / CONFIG_NAME).read_text())["training"]
    assert training["device"] == "cpu" and training["autocast"] == "off" and training["complete"] is True
    capsys.readouterr()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert err.startswith("stagedspec: error:") and "no CUDA GPU is available" in err and err.count("\n") == 1
    assert run(["eval-draft", "--oracle", str(oracle_dir), "--draft", str(out), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is available" in err and err.count("\n") == 1
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--device", "tpu")) == 2
    assert "unknown device" in capsys.readouterr().err


def test_eval_draft_depths_positions_and_drafts_side_by_side(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, corpus, out, "--device", "cpu")) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\n\ndef g(a, b):\n")
    common = ["eval-draft", "--oracle", str(oracle_dir), "--prompts", str(prompts), "--tokens", "20",
              "--accept-prompts", "1", "--accept-tokens", "8", "--tree-depth", "3", "--chain-length", "2",
              "--dtype", "fp32", "--device", "cpu"]
    capsys.readouterr()

    # One draft: the JSON object as before, with the figures per reply position and per depth.
    assert run(common + ["--draft", str(out), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert list(one["by_position"]) == ["0-15", "16-63", "64+"]
    buckets = one["by_position"]
    assert buckets["0-15"]["positions"] + buckets["16-63"]["positions"] == one["positions"] > 16
    assert buckets["64+"]["positions"] == 0 and buckets["64+"]["top1"] is None
    n = one["positions"]
    assert abs(sum(b["top1"] * b["positions"] for b in buckets.values() if b["positions"]) / n - one["top1"]) < 1e-9
    assert len(one["chain_depth_reach"]) == 2 and len(one["tree_depth_reach"]) == 3
    for kind in ("chain", "tree"):
        reach = one[f"{kind}_depth_reach"]
        assert all(1 >= a >= b >= 0 for a, b in zip(reach, reach[1:]))  # deeper is reached no more often
        assert abs(1 + sum(reach) - one[f"{kind}_mean_accepted_length"]) < 1e-9

    # The tree after every reply prefix: one tree per agreement position, the same depth identity.
    every = one["tree_every_position"]
    assert every["trees"] == one["positions"] and every["draft_passes_per_tree"] > 0
    assert all(1 >= a >= b >= 0 for a, b in zip(every["depth_reach"], every["depth_reach"][1:]))
    assert abs(1 + sum(every["depth_reach"]) - every["mean_accepted_length"]) < 1e-9
    assert every["growth"] == "best-first"  # auto on a CPU: what `tree` decodes with here
    # Level-by-level growth needs static passes; without them, one clear line.
    assert run(common + ["--draft", str(out), "--tree-growth", "levels", "--json"]) == 2
    assert "needs static-shape passes" in capsys.readouterr().err

    # Two drafts (a repeated flag and a comma list, the duplicate dropped): one table, a column each,
    # measured on the same oracle replies.
    assert run(common + ["--draft", str(out), "--draft", f"layers:1,{out}"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("2 drafts vs oracle")
    header = text.splitlines()[1].split()
    assert header == ["draft", "layers:1"]
    for row in ("top-1", "top-4 @ reply 0-15", "mean accepted, tree 16", "tree reaches depth 3",
                "mean accepted, tree 16, every position", "cost (bfloat16", "draft targets met"):
        assert any(line.strip().startswith(row) for line in text.splitlines()), row
    assert run(common + ["--draft", f"{out},layers:1", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert [r["draft"] for r in both["drafts"]] == [str(out), "layers:1"]
    assert both["drafts"][0]["top1"] == one["top1"] and both["drafts"][0]["by_position"] == one["by_position"]
    assert both["drafts"][0]["positions"] == both["drafts"][1]["positions"]
    assert both["drafts"][0]["oracle_ms_per_token"] == both["drafts"][1]["oracle_ms_per_token"]

    # A single draft still prints the readable report.
    assert run(common + ["--draft", str(out)]) == 0
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and "by reply position 0-15" in text and "depth reached" in text
    assert "after every reply prefix" in text and "(target >= 60%: " in text and "(target <= 0.1: " in text
    assert run(common + ["--draft", str(out), "--no-every-position", "--json"]) == 0
    assert "tree_every_position" not in json.loads(capsys.readouterr().out)


def test_eval_draft_checks_the_draft_targets() -> None:
    """top-1 >= 60%, top-4 >= 80%, cost <= 0.10, tree-16 >= 3.5 (decoding and every position); tree targets only
    at budget 16, and only the figures a report has."""
    from stagedspec.cli.distill import targets_met

    report = {"top1": 0.593, "top4": 0.81, "draft_cost_ratio": 0.088, "tree_every_position": {"mean_accepted_length": 3.5}}
    got = targets_met(report, 16)
    assert {k: v["met"] for k, v in got.items()} == {"top1": False, "top4": True, "draft_cost_ratio": True,
                                                      "tree_every_position": True}
    assert got["top1"]["value"] == 0.593 and got["top1"]["target"] == 0.60
    assert "tree_every_position" not in targets_met(report, 8)


def test_tree_acceptance_everywhere_with_the_oracle_as_its_own_draft(oracle_dir: Path) -> None:
    """A draft that is the oracle (fp32) spells the oracle's greedy reply: every chain is accepted whole."""
    from stagedspec.models.loading import load_model
    from stagedspec.training.distill import oracle_greedy_continuations
    from stagedspec.tree import TokenTree
    from stagedspec.tree_acceptance import matched_depth, tree_acceptance_everywhere

    oracle, _ = load_model(str(oracle_dir), dtype=torch.float32)
    prompts = [[1, 5, 9, 3], [2, 2, 7]]
    replies = oracle_greedy_continuations(oracle, prompts, 10)
    depth = 3
    got = tree_acceptance_everywhere(oracle, prompts, replies, tree_budget=depth, max_depth=depth, branching=1)
    lengths = [min(depth, len(r) - i) for r in replies for i in range(len(r))]
    assert got["trees"] == len(lengths)
    assert abs(got["mean_accepted_length"] - (1 + sum(lengths) / len(lengths))) < 1e-9

    assert got["growth"] == "best-first"

    # Grown level by level (CUDA's growth; static passes), the same chains are spelt.
    from stagedspec.runner import set_pass_mode

    set_pass_mode(oracle, "static")
    by_level = tree_acceptance_everywhere(oracle, prompts, replies, tree_budget=depth, max_depth=depth, branching=1,
                                          growth="levels")
    assert by_level["growth"] == "levels" and by_level["trees"] == got["trees"]
    assert abs(by_level["mean_accepted_length"] - got["mean_accepted_length"]) < 1e-9

    tree = TokenTree([0, 4, 6, 5, 8], [-1, 0, 0, 2, 3])  # root -> 4; root -> 6 -> 5 -> 8
    assert matched_depth(tree, [6, 5, 9]) == 2 and matched_depth(tree, [4, 1]) == 1
    assert matched_depth(tree, [7]) == 0 and matched_depth(tree, [6, 5, 8, 1]) == 3 and matched_depth(tree, []) == 0


def test_autocast_on_the_cpu_is_opt_in_and_recorded(oracle_dir: Path, corpus: list[str], tmp_path: Path) -> None:
    """`--autocast` runs the draft's CPU passes under bf16 autocast (for CPUs with native bf16 matmuls)."""
    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, corpus, out, "--autocast")) == 0
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["training"]["autocast"] == "bf16" and cfg["training"]["complete"] is True
    assert run(distill_args(oracle_dir, corpus, tmp_path / "off", "--no-autocast")) == 0
    assert json.loads((tmp_path / "off" / CONFIG_NAME).read_text())["training"]["autocast"] == "off"


def test_sample_from_adds_requests_from_other_python_sources(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`--sample-from` widens the pool of oracle requests (folders walked, tests skipped), not the plain corpus."""
    from stagedspec.cli.distill import request_files

    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "core.py").write_text(CODE * 3)  # three copies of its one multi-line request
    (pkg / "tests" / "test_core.py").write_text(CODE)
    (pkg / "notes.txt").write_text("not python")
    assert request_files([str(pkg)]) == [pkg / "core.py"]
    plain = tmp_path / "plain.txt"
    plain.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, [str(plain)], out, "--oracle-samples", "3", "--sample-tokens", "3",
                            "--sample-from", str(pkg))) == 0
    corpus_meta = json.loads((out / CONFIG_NAME).read_text())["training"]["corpus"]
    assert corpus_meta["oracle_samples"] == 3 and corpus_meta["files"] == 1
    capsys.readouterr()
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--oracle-samples", "2",
                            "--sample-from", str(tmp_path / "missing"))) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--sample-from", str(pkg))) == 2
    assert "give --oracle-samples N too" in capsys.readouterr().err
    bad = tmp_path / "human_eval"
    bad.mkdir()
    (bad / "data.py").write_text(CODE)
    assert run(distill_args(oracle_dir, corpus, tmp_path / "d", "--oracle-samples", "2", "--sample-from", str(bad))) == 2
    assert "HumanEval must never be used" in capsys.readouterr().err


def test_samples_cache_is_shared_between_runs(oracle_dir: Path, corpus: list[str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--samples-cache FILE`: a second round with other work and output folders asks the oracle nothing new."""
    shared = tmp_path / "shared" / "replies.jsonl"
    sampling = ["--oracle-samples", "2", "--sample-tokens", "3", "--sample-batch", "2", "--samples-cache", str(shared)]
    assert run(distill_args(oracle_dir, corpus, tmp_path / "a", *sampling)) == 0
    lines = shared.read_text().splitlines()
    distinct = set(sample_requests([Path(c) for c in corpus], 2, seed=0))  # the corpus repeats its functions
    assert len(lines) == len(distinct) and not (tmp_path / "a" / "oracle_samples.jsonl").exists()
    assert run(distill_args(oracle_dir, corpus, tmp_path / "b", "--work-dir", str(tmp_path / "wb"), *sampling)) == 0
    assert shared.read_text().splitlines() == lines  # nothing regenerated, nothing appended
    capsys.readouterr()
    assert run(distill_args(oracle_dir, corpus, tmp_path / "c", "--oracle-samples", "2",
                            "--samples-cache", str(tmp_path))) == 2
    assert "is a folder" in capsys.readouterr().err


def test_eval_draft_compares_a_drafts_weight_formats_in_one_run(oracle_dir: Path, corpus: list[str],
                                                                tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`--draft D@native,D@int8` (bf16): two columns on the same oracle replies, each naming its weights; int8 in
    fp32 without the native kernels is refused in one line."""
    import stagedspec.draft_weights as draft_weights

    out = tmp_path / "draft"
    assert run(distill_args(oracle_dir, corpus, out, "--device", "cpu")) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\n\ndef g(a, b):\n")
    capsys.readouterr()
    assert run(["eval-draft", "--oracle", str(oracle_dir), "--prompts", str(prompts), "--tokens", "16",
                "--accept-prompts", "0", "--no-every-position", "--dtype", "bf16",
                "--draft", f"{out}@native,{out}@int8", "--json"]) == 0
    native, int8 = json.loads(capsys.readouterr().out)["drafts"]
    assert (native["weights"], int8["weights"]) == ("native", "int8")
    assert native["positions"] == int8["positions"] > 0
    monkeypatch.setattr(draft_weights, "native_kernels", lambda quiet=False: None)
    assert run(["eval-draft", "--oracle", str(oracle_dir), "--prompts", str(prompts), "--draft", str(out),
                "--dtype", "fp32", "--draft-weights", "int8"]) == 2
    assert "--draft-weights int8 computes in bf16" in capsys.readouterr().err


def test_feature_draft_with_a_pruned_mlp_an_oracle_head_and_int8_weights(oracle_dir: Path, corpus: list[str],
                                                                         tmp_path: Path) -> None:
    """The shipped Qwen feature draft's form: fewer MLP channels than the oracle's layer, a head of the oracle's
    own rows (saved as token ids alone) and int8 codes with a scale per group of 32.  It loads back computing
    what was trained, up to the int8 rounding, and the file holds no head rows."""
    from safetensors import safe_open

    from stagedspec.models.draft import INT8_SCALE_SUFFIX

    out = tmp_path / "feature"
    rc = run(distill_args(oracle_dir, corpus, out, "--kind", "feature", "--ttt-steps", "2", "--mlp-width", "32",
                          "--head-from-oracle", "--save-dtype", "int8"))
    assert rc == 0
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["head"] == "oracle-rows" and cfg["dtype"] == "int8" and cfg["model_config"]["intermediate_size"] == 32
    with safe_open(str(out / WEIGHTS_NAME), "pt") as f:
        names = set(f.keys())
        assert not any(n.startswith("head.") for n in names) and "head_tokens" in names
        assert f.get_tensor("layers.0.mlp.w_up.weight").dtype == torch.int8
        assert "fc.weight" + INT8_SCALE_SUFFIX in names
    oracle, _ = load_model(str(oracle_dir), dtype=torch.float32)
    draft = load_draft(out, oracle)
    assert draft.layers[0].mlp.w_up.weight.shape[0] == 2 * 32 and draft.head_from_oracle
    rows = oracle.head_weight[draft.head_tokens]
    assert torch.equal(draft.head.weight, rows.to(draft.head.weight.dtype))  # the oracle's rows, untouched
    ckpt = torch.load(tmp_path / "feature" / "checkpoint.pt", weights_only=True)["model"]
    w = ckpt["layers.0.mlp.w_down.weight"]
    assert torch.allclose(draft.layers[0].mlp.w_down.weight, w, atol=float(w.abs().max()) / 127 + 1e-6)
    # the draft so far of a checkpoint (scripts/distill/checkpoint_draft.py): the same draft, its weights exact
    from stagedspec.training.distill import draft_from_checkpoint

    again = draft_from_checkpoint(out / "checkpoint.pt", oracle, draft.fingerprint)
    assert again.head_from_oracle and again.training_meta["steps_done"] == 4 and again.training_meta["complete"]
    assert all(torch.equal(v, ckpt[k]) for k, v in again.own_state_dict().items())


def test_general_requests_are_distinct_seeded_and_never_a_held_out_bench_subject() -> None:
    """`--chat-samples`: prose and chat requests made offline; none may touch a held-out bench prompt's subject
    (`bench.prompts.PROSE` / `CHAT`), or the bench would measure text the draft was trained on."""
    from stagedspec.bench.prompts import CHAT, PROSE
    from stagedspec.training.chat_requests import general_requests, held_out_words

    requests = general_requests(400, seed=1)
    assert len(requests) == len(set(requests)) == 400 and requests == general_requests(400, seed=1)
    assert requests != general_requests(400, seed=2)
    assert not set(requests) & set(PROSE + CHAT)
    lowered = [r.lower() for r in requests]
    assert not [r for r in lowered for w in held_out_words() if w in r]
    for prompt in PROSE + CHAT:  # every held-out prompt names a subject on the list
        assert any(w in prompt.lower() for w in held_out_words()), prompt


def test_a_draft_made_from_a_quantised_oracle_trains_through_pytorch_s_norms(oracle_dir: Path) -> None:
    """The native norm and attention kernels have no backward.  A draft copied from an oracle on them (distill
    --quant, a feature draft learning the features users decode with) must run PyTorch's, or the gradients
    through its norms are silently wrong (PyTorch only warns)."""
    import warnings

    from stagedspec.models.feature_draft import FeatureDraftModel
    from stagedspec.models.quant import NativeRMSNorm

    oracle, _ = load_model(str(oracle_dir), dtype=torch.float32, quant="int8")
    if not any(isinstance(m, NativeRMSNorm) for m in oracle.modules()):
        pytest.skip("the native kernels are not built here, so the oracle runs PyTorch's norms anyway")
    draft = FeatureDraftModel(oracle, 1, torch.arange(32), dtype=torch.float32, head_from_oracle=True)
    assert not any(isinstance(m, NativeRMSNorm) for m in draft.modules())
    assert all(layer.attn.native_attention is None for layer in draft.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sum(h.sum() for h in draft.unrolled_hidden(torch.randint(0, 32, (1, 8)), None, 2)).backward()
    assert draft.norm.weight.grad is not None and draft.layers[0].attn_norm.weight.grad is not None
