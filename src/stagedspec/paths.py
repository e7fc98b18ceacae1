"""Where stagedspec keeps what it builds and measures: one folder, `$STAGEDSPEC_CACHE` or `~/.cache/stagedspec`.

Its own module, with no imports from the package, so that the cost profiles,
the kernels' build, the n-gram tables and the assembled models can all find
the folder without importing each other (it lived in `models/default.py`,
which put those modules in import cycles through the model loaders).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: written to a temporary file of this process, then renamed, so a
    reader (or a process measuring beside this one) never sees a half-written file.  Raises OSError."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def cache_root() -> Path:
    """`$STAGEDSPEC_CACHE` if set, else `~/.cache/stagedspec` (read at every call: tests point it elsewhere)."""
    env = os.environ.get("STAGEDSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stagedspec"


def learned_store() -> Path:
    """The one folder every timed choice and learned figure of this machine lives in: the cost profiles,
    each measured method's policy, the fp32 matmul plans and the drafts' weight formats, all JSON
    (`stagedspec tune --reset` empties it).  Built things, the kernels and the n-grams, live beside it."""
    return cache_root() / "costs"
