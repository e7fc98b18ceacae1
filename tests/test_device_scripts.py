"""scripts/device/common.sh, the steps every GPU run's scripts share: cutting a stream into one part per call,
setting paths aside and putting them back, keeping folders out of git.

Its callers run on a lent GPU where a slip costs device time, so the helpers are run here, in a scratch repo.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

COMMON = Path(__file__).resolve().parents[1] / "scripts" / "device" / "common.sh"


def sh(repo: Path, script: str, stdin: bytes = b"") -> str:
    run = subprocess.run(["bash", "-c", f"set -euo pipefail; source {COMMON}; {script}"], cwd=repo, input=stdin,
                         capture_output=True)
    assert run.returncode == 0, run.stderr.decode()
    return run.stdout.decode()


def test_a_stream_is_cut_into_one_folder_per_call_and_joins_back(tmp_path: Path) -> None:
    data = bytes(range(256)) * 3 + b"tail"
    assert sh(tmp_path, "split_into_calls parts 300", data).strip() == "3"
    parts = sorted((tmp_path / "parts").iterdir())
    assert [p.name for p in parts] == ["p0", "p1", "p2"]
    assert b"".join(next(p.iterdir()).read_bytes() for p in parts) == data


def test_paths_set_aside_come_back_and_excluded_folders_are_listed_once(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"x" * 10)
    aside = tmp_path / "aside"
    sh(tmp_path, f"ASIDE={aside}; set_aside data docs/missing")
    assert not (tmp_path / "data").exists() and (aside / "data" / "x.bin").is_file()
    sh(tmp_path, f"ASIDE={aside}; put_back data docs/missing")
    assert (tmp_path / "data" / "x.bin").read_bytes() == b"x" * 10
    sh(tmp_path, "exclude_here /.whl/ /p0/; exclude_here /.whl/")
    lines = (tmp_path / ".git" / "info" / "exclude").read_text().splitlines()
    assert lines.count("/.whl/") == 1 and lines.count("/p0/") == 1
    (tmp_path / "p0").mkdir()  # excluded, so counted once: as the part a call carries, not as working tree
    (tmp_path / "p0" / "part00").write_bytes(b"y" * 3_000_000)
    assert int(sh(tmp_path, "carried_mib p0")) == 2
