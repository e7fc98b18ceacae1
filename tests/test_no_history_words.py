"""The tracked texts speak of the product, not of how it was built: no session, issue or round numbers.

What was measured is named by its machine, date and commit instead (docs/benchmarks.md).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATTERN = re.compile(r"session [0-9]|sessions [0-9]|issue [0-9]|round [0-9]|rounds [0-9]", re.IGNORECASE)
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
MAX_BYTES = 2_000_000  # larger tracked files are data (bench results), read up to this much


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if out.returncode != 0:
        pytest.skip("git ls-files failed: not a git checkout")
    return [name for name in out.stdout.decode("utf-8", "replace").split("\0") if name]


def test_no_history_words_in_tracked_text_files() -> None:
    hits = []
    for name in _tracked_files():
        if name == THIS:
            continue
        path = ROOT / name
        try:
            with path.open("rb") as f:
                data = f.read(MAX_BYTES)
        except OSError:  # listed but absent from the work tree (deleted, not yet committed)
            continue
        if b"\0" in data[:8192]:  # binary
            continue
        text = data.decode("utf-8", "replace")
        for number, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "history words in tracked files (name the machine, date or commit instead):\n" + "\n".join(hits)
