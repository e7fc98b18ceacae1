"""The GPU round's scripts (scripts/gpu_round/): they parse, and at toy scale on the CPU they run end to end.

The round runs where no test can follow it (a lent GPU, one attempt per session), so its commands are checked
here: a typo found on the device costs the session's device time.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_round"


@pytest.mark.parametrize("name", ["prepare.sh", "remote.sh", "round.sh"])
def test_gpu_round_scripts_parse(name: str) -> None:
    run = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_remote_script_refuses_an_unknown_call() -> None:
    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), "nonsense"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage" in run.stderr


def test_full_scale_round_commands_parse_with_the_cli(tmp_path: Path) -> None:
    """DRYRUN=1 writes the full-scale commands: one reply sampling, three trainings (the independent draft and two
    feature drafts converted from it), one eval-draft of all of them; every one is valid for the real CLI."""
    import shlex

    from stagedspec.cli import build_parser

    env = {**os.environ, "DRYRUN": "1", "ROUND_DIR": str(tmp_path / "r"), "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(SCRIPTS / "round.sh")], cwd=SCRIPTS.parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    commands = [shlex.split(line)[1:] for line in (tmp_path / "r" / "commands").read_text().splitlines()]
    parsed = [build_parser().parse_args(c) for c in commands]
    assert sorted(a.func.__name__ for a in parsed) == ["cmd_distill"] * 4 + ["cmd_eval_draft"]
    runs = {Path(a.out).name: a for a in parsed if a.func.__name__ == "cmd_distill"}  # the three run at once
    presample, ind, feat_a, feat_b = (runs[n] for n in ("presample", "ind", "featA", "featB"))
    evaluate = parsed[-1]
    assert all(a.device == "cuda" and a.init_from == "default" and a.oracle_samples == 12000 and a.seed == 9
               for a in runs.values())
    assert presample.stop_after_steps == 1 and ind.kind == "independent" and ind.tokens == 8_000_000
    assert feat_a.kind == feat_b.kind == "feature" and feat_a.fc_lr_scale == 0 and feat_b.fc_lr_scale == 0.2
    assert feat_a.ttt_steps == 3 and feat_a.feature_loss == 0 and feat_a.samples_cache != feat_b.samples_cache
    assert evaluate.device == "cuda" and evaluate.json and len(evaluate.draft[0].split(",")) == 4


@pytest.mark.slow
@pytest.mark.real_model
def test_gpu_round_runs_end_to_end_at_toy_scale_on_the_cpu(tmp_path: Path) -> None:
    """SMOKE=1: the same distill and eval-draft commands, a few steps each; every one exits 0 and the files that
    would come back from the device are there (about 4 minutes on 2 cores)."""
    env = {**os.environ, "SMOKE": "1", "DEVICE": "cpu", "ROUND_DIR": str(tmp_path / "r"), "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(SCRIPTS / "round.sh")], cwd=SCRIPTS.parents[1], env=env,
                         capture_output=True, text=True, timeout=1200)
    status = (tmp_path / "r" / "status").read_text()
    for step in ("presample", "ind", "featA", "featB", "eval-draft"):
        assert f"{step} exit 0" in status, status + run.stdout[-2000:] + run.stderr[-2000:]
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "reports.tgz" in back and any(n.startswith("ind.tar.") for n in back), back
    assert any(n.startswith("feat") for n in back), back
    assert len(back) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in (tmp_path / "out").iterdir())
