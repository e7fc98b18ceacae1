"""`stagedspec check` on a tiny random Llama (GQA) with a one-layer truncated draft.

The command must pass on a correct pair, exit 1 with FAIL rows when a wrong verifier is put into the
real (non-control) path, flag its own negative control, and give one-line errors for bad input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagedspec.check import chi_square, detectable_tv, wrong_q_distribution
from stagedspec.cli import main
from stagedspec.sampling import SamplingParams
from stagedspec.verification import deterministic_node_rule, verify, walk_tree

pytestmark = pytest.mark.usefixtures("one_thread", "private_cost_cache")  # tiny tensors; no cache writes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:  # noqa: ANN001
    from _tiny_models import save_tiny_hf  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("check") / "tiny-llama"
    save_tiny_hf("llama_gqa", folder)
    return folder


def run_check(args: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    if "--ngram" not in args:  # no stdlib n-gram build for the tiny tokenizer: prompt lookup is enough here
        args = [*args, "--ngram", "none"]
    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out: str, part: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(part + " ")]


def test_check_passes_on_a_correct_pair_and_flags_its_control(tiny: Path, capsys) -> None:  # noqa: ANN001
    code, out, err = run_check(["--oracle", str(tiny), "--draft", "layers:1", "--quick"], capsys)
    assert code == 0, out + err
    greedy = rows(out, "greedy")
    # chain tree lookup staged auto, in fp32 (and in bf16 bit-exact where --dtype auto picks bf16)
    assert len(greedy) in (5, 10) and all(" PASS " in r for r in greedy), greedy
    assert all("mean accepted length " in r for r in greedy), greedy  # and drafts were accepted (else FAIL)
    sampling = rows(out, "sampling")
    assert len(sampling) == 2 and all(" PASS " in r for r in sampling), sampling
    assert all("detects TV >=" in r for r in sampling)
    control = rows(out, "control")
    assert len(control) == 2 and all(" FLAGGED " in r for r in control), control
    assert len(rows(out, "speed")) == 6
    assert "result: PASS" in out


def biased_deterministic_verify(tree, logits, sampling, generator):  # noqa: ANN001, ANN201
    """WRONG: a fixed proposal accepted w.p. p(x), but a rejection draws from p itself, not p without x."""
    if sampling.greedy:
        return verify(tree, logits, sampling, generator)

    def rule(p, tokens, q, gen):  # noqa: ANN001, ANN202
        return deterministic_node_rule(p, tokens, None, gen)[0], p

    return walk_tree(tree, logits, sampling, generator, rule)


def test_fp32_as_a_reference_only_measures_nothing_of_its_own_speed(tiny: Path, capsys,  # noqa: ANN001
                                                                      monkeypatch) -> None:  # noqa: ANN001
    """With int8 serving weights, the fp32 models are only the greedy reference: their kernels are not timed,
    their `auto` takes its arms by a hand-made profile, and only the serving models' costs are measured."""
    import os

    import stagedspec.profiling as profiling
    import stagedspec.models.matmul_plan as matmul_plan

    planned, measured = [], []
    real_measure = profiling.measure_profile

    def measure_profile(oracle, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        measured.append(oracle.quantised)
        return real_measure(oracle, *args, **kwargs)

    monkeypatch.setattr(matmul_plan, "apply_plan", lambda model, plans: planned.append(model))
    monkeypatch.setattr(profiling, "measure_profile", measure_profile)
    code, out, err = run_check(["--oracle", str(tiny), "--draft", "layers:1", "--quick", "--quant", "int8",
                                "--samples", "300"], capsys)
    assert code == 0, out + err
    greedy = rows(out, "greedy")
    assert len(greedy) == 10 and all(" PASS " in r for r in greedy), greedy  # fp32, then int8 bit-exact
    assert planned == []  # the fp32 reference ran plain F.linear (the int8 oracle and its layers:1 have no fp32 layers)
    assert matmul_plan.OFF_ENV not in os.environ  # and the switch was put back
    assert measured and all(measured), measured  # profiles of the int8 oracle only
    assert "fp32 is the reference here" in out


def test_a_wrong_verifier_in_the_real_path_fails(tiny: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("stagedspec.generation.verify", biased_deterministic_verify)
    code, out, err = run_check(["--oracle", str(tiny), "--draft", "layers:1", "--quick"], capsys)
    assert code == 1, out + err
    assert all(" FAIL " in r for r in rows(out, "sampling")), rows(out, "sampling")
    assert all(" PASS " in r for r in rows(out, "greedy"))  # greedy goes through the real rule
    assert "result: FAIL" in out


def reject_every_draft(tree, logits, sampling, generator):  # noqa: ANN001, ANN201
    """WRONG for speed, right for output: greedy steps accept no drafted token and emit the oracle's own argmax,
    so every method's greedy output is still `ar`'s, and an identity with `ar` alone would pass."""
    from stagedspec.verification import VerifyResult

    if not sampling.greedy:
        return verify(tree, logits, sampling, generator)
    return VerifyResult([], int(logits[0].argmax()))


def test_greedy_rows_fail_when_no_draft_was_accepted(tiny: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """Outputs identical to `ar` with nothing drafted accepted prove nothing: each such row FAILs and says why."""
    monkeypatch.setattr("stagedspec.generation.verify", reject_every_draft)
    code, out, err = run_check(["--oracle", str(tiny), "--draft", "layers:1", "--quick", "--samples", "300"],
                               capsys)
    assert code == 1, out + err
    greedy = rows(out, "greedy")
    assert greedy and all(" FAIL " in r and "prompts identical" in r and "mean accepted length 1.00" in r
                          and "no drafted token was accepted (" in r and "tested nothing" in r
                          for r in greedy), greedy
    assert "result: FAIL" in out


def test_no_draft_skips_draft_methods(tiny: Path, capsys) -> None:  # noqa: ANN001
    code, out, err = run_check(["--oracle", str(tiny), "--quick", "--samples", "300", "--top-k", "0",
                                "--temperature", "1"], capsys)
    assert code == 0, out + err
    skipped = [r for r in rows(out, "greedy") if " SKIP " in r]
    assert len(skipped) in (3, 6) and all("needs a draft" in r for r in skipped)  # (6: fp32 and bf16 rows)
    assert len(rows(out, "sampling")) == 1  # the user's sampling equals T=1: one row
    assert "lookup first token" in rows(out, "sampling")[0]
    assert "oracle's first layer" in rows(out, "control")[0]


@pytest.mark.parametrize("extra, needle", [
    (["--oracle", "/no/such/model"], "/no/such/model"),
    (["--draft", "layers:x"], "layers:N"),
    (["--temperature", "0"], "temperature"),
    (["--top-p", "2"], "top-p"),
    (["--samples", "5"], "samples"),
    (["--device", "cuda"], "cuda"),
])
def test_bad_input_is_a_one_line_error(tiny: Path, extra: list[str], needle: str, capsys) -> None:  # noqa: ANN001
    args = ["--oracle", str(tiny), "--quick", *extra] if "--oracle" not in extra else ["--quick", *extra]
    code, _, err = run_check(args, capsys)
    assert code == 2, err
    assert "error:" in err and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_statistics_helpers() -> None:
    # The toy suite's figure: about 4,000 samples detect TV ~0.07 in the worst case (df 7 to 103).
    assert 0.04 < detectable_tv(4000, 7) < detectable_tv(4000, 100) < 0.08
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert chi_square({3: 1, 0: 10}, p)[0] == 0.0  # a draw where p = 0 fails outright
    assert chi_square({0: 500, 1: 300, 2: 200}, p)[0] > 0.99
    # The wrong-q rule on one fixed proposal: x is emitted w.p. min(1, p/q), not p.
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    assert wrong_q_distribution(p, [0], q)[0] == pytest.approx(1.0)
    assert float(wrong_q_distribution(p, [2], q).sum()) == pytest.approx(1.0)


@pytest.mark.real_model
@pytest.mark.slow  # ~30 s alone, but `auto` re-measures its cost profile in the private cache: ~100 s shared
def test_check_quick_on_the_default_models(capsys) -> None:  # noqa: ANN001
    code, out, err = run_check(["--quick"], capsys)
    assert code == 0, out + err
    assert all(" FLAGGED " in r for r in rows(out, "control"))
