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
