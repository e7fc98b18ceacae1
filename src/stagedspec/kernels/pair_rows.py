"""From how many rows the 512-bit VNNI path pairs its tiles: timed once per machine and kernels, kept beside the
cost profiles.

Why measured: a pair of tiles (`*_pair_vnni512` in `qlinear.cpp`) issues one set of float steps, broadcasts and
loads for two tiles' outputs, so a pass bound by arithmetic runs faster on pairs; a pass bound by reading the
weights reads two streams side by side instead of one.  Where one gives way to the other differs by CPU: on a
Zen 5 EPYC whole Qwen2.5-Coder-1.5B passes of 2 and 3 rows ran 1.04-1.17x slower on pairs, so pairs started at
4 rows (docs/kernels.md, "Pairs of tiles from 4 rows up on Zen 5"); on a Zen 4 EPYC, whose 512-bit operations
split in two halves, the same passes ran 0.94x (2 rows) and 0.86x (3 rows) the time on pairs (docs/kernels.md,
"Pairs of tiles from 2 rows up on Zen 4").  The pairs give the same bits as single tiles, so the choice is speed
alone.

What is timed: calls of 1, 2 and 3 rows over 145 MB of Q4_K tiles on 2 MB pages (`prefetch.stream_sweep`, the
weights from memory as in a real pass), each row count with and without pairs, best of `SWEEPS` interleaved
sweeps: about 0.2 s, once, where the kernels run the 512-bit path.  Kept in `pair-rows.json` in the learned
store; `stagedspec tune` times it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from stagedspec import hardware, measured_cache
from stagedspec.kernels import prefetch
from stagedspec.paths import learned_store

DEFAULT = 4  # the kernels' own threshold (`g_pair_min_rows`), measured on Zen 5
CANDIDATES = (1, 2, 3)  # row counts timed; pairs from the least of them that pays at it and every larger one
GAIN = 1.03  # the least speedup of pairs at a row count that counts as paying (timing noise keeps the default)
SWEEPS = 5

# (rows, pairs on) -> seconds of one sweep
Timer = Callable[[int, bool], float]


def threshold(seconds: dict[tuple[int, bool], float]) -> int:
    """The least timed row count from which pairs beat single tiles by `GAIN` at every larger count timed
    (`DEFAULT` where none does)."""
    rows = sorted({r for r, _ in seconds})
    for i, n in enumerate(rows):
        if all(seconds[(m, False)] >= GAIN * seconds[(m, True)] for m in rows[i:]):
            return n
    return DEFAULT


def stream_timer(sweep: prefetch.Sweep) -> Timer:
    """A timer of one sweep of `rows`-row calls over streamed Q4_K tiles, pairs on or off (`sweep`: the prefetch
    timing's `prefetch.stream_sweep`, on kernels of the 512-bit path; its copies serve both timings)."""
    pair_from = torch.ops.stagedspec_qlinear.pair_min_rows
    return lambda rows, pairs: sweep(rows if pairs else rows + 1, rows, pair_from)


def measured_pair_rows(timer: Timer, kernels_digest: str, *, cache_file: Path | None = None,
                       quiet: bool = False) -> int:
    """The row count from which tiles are paired on this machine, timed once with `timer` and cached under the
    kernels' source digest and the machine (`measured_cache.once`).  The caller sets the kernels' setting."""
    def measure() -> dict:
        for r in CANDIDATES:  # first touch of every copy, untimed
            timer(r, True)
        best = {(r, p): float("inf") for r in CANDIDATES for p in (True, False)}
        for _ in range(SWEEPS):
            for key_rp in best:
                best[key_rp] = min(best[key_rp], timer(*key_rp))
        return {"rows": threshold(best), "sweep_ms": {f"{r} rows, {'pairs' if p else 'single'}": round(1e3 * s, 3)
                                                      for (r, p), s in best.items()}}

    entry = measured_cache.once(
        cache_file or cache_path(), f"{kernels_digest}|{hardware.fingerprint('cpu')}",
        lambda e: isinstance(e, dict) and e.get("rows") in (*CANDIDATES, DEFAULT), measure,
        None if quiet else "stagedspec: timing from how many rows the 512-bit tiles pair up on this CPU "
                           "(once; cached)...")
    return int(entry["rows"])


def forget_measured_pair_rows(cache_file: Path | None = None) -> None:
    """Drop the cached timing (`stagedspec tune` times it again)."""
    measured_cache.forget(cache_file or cache_path())


def cache_path() -> Path:
    return learned_store() / "pair-rows.json"
