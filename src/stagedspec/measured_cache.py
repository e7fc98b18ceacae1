"""A JSON file of timed choices kept beside the cost profiles (draft weight formats, fp32 matmul kernels).

Why one module: such a file is read on every load and written after a
measurement, possibly by several processes at once; a missing or unreadable
file only means timing again, and a read-only cache folder only means timing
again next time.  Its users need exactly that, and nothing more (`once`: the
whole pattern, for the kernels' settings).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from stagedspec.paths import write_text_atomic


def read(path: Path) -> dict:
    """The file's entries ({} when there is none yet, or it cannot be read: the caller times again)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write(path: Path, data: dict) -> None:
    """Replace the file with `data` atomically (a process-private temporary file, then a rename)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1))
    except OSError:
        pass  # a read-only cache folder costs a re-measure next time, nothing else


def forget(path: Path) -> None:
    """Delete the file (`stagedspec tune` times everything again)."""
    try:
        path.unlink()
    except OSError:
        pass  # none yet


def once(path: Path, key: str, valid: Callable[[Any], bool], measure: Callable[[], dict], notice: str | None) -> dict:
    """The entry `key` of the file at `path` where it is `valid`, else `measure()`'s, written there first.

    What every timed-once-per-machine setting does (the kernels' prefetch distance, pairing and AMX rows): the key
    names the kernels and the machine, so a change of either times again; `notice` (None: quiet) is the one line
    said on stderr before timing."""
    data = read(path)
    entry = data.get(key)
    if valid(entry):
        return entry
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)
    data[key] = entry = measure()
    write(path, data)
    return entry
