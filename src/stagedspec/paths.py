"""Where stagedspec keeps what it builds and measures: one folder, `$STAGEDSPEC_CACHE` or `~/.cache/stagedspec`.

Its own module, with no imports from the package, so that the cost profiles,
the kernels' build, the n-gram tables and the assembled models can all find
the folder without importing each other (it lived in `models/default.py`,
which put those modules in import cycles through the model loaders).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$STAGEDSPEC_CACHE` if set, else `~/.cache/stagedspec` (read at every call: tests point it elsewhere)."""
    env = os.environ.get("STAGEDSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stagedspec"
