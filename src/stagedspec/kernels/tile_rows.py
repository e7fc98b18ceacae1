"""From how many rows a pass runs on AMX tiles: timed once per machine and kernels, kept beside the cost profiles.

Why measured: AMX tiles (`qlinear_amx.inc`) give the same bits as the AVX-512 VNNI tiles, so choosing between
them is a matter of speed alone, and that depends on the row count.  A tile product takes the same time for 1 row
as for 16, and every group's sums go through memory, so below some row count the VNNI tiles are faster; above
it the tiles' multiply-adds win.  Where that count lies differs by CPU and weight format, so it is timed here,
per format, on one 1536 x 1536 matrix held in cache (the rows' arithmetic, not memory, is what differs), each
row count as the best of a few sweeps with both paths interleaved, and kept in `amx-rows.json` in the learned
store (`stagedspec tune` times it again).  A pass runs on tiles from the largest of the formats' thresholds, so
it is never slower on any of them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from stagedspec import hardware, measured_cache
from stagedspec.kernels.packing import FORMATS, random_format
from stagedspec.paths import learned_store

AMX_ISA = 4  # `qlinear.cpp`'s kAmx
CANDIDATE_ROWS = (4, 8, 12, 16, 24, 32, 48, 64)  # the row counts timed; a pass below the first stays on VNNI
NEVER = 0  # `tile_rows` where tiles are never faster
SIZE = 1536
SWEEPS, CALLS = 5, 16

# (format number, rows) -> (seconds on VNNI, seconds on AMX)
Timer = Callable[[int, int], tuple[float, float]]
# (instruction-set path, x [rows, SIZE], packed weight, format number) -> the layer's output: the kernels' qlinear
Run = Callable[[int, torch.Tensor, torch.Tensor, int], torch.Tensor]


def threshold(timings: dict[int, tuple[float, float]]) -> int:
    """The least timed row count from which tiles are faster at every larger count timed (NEVER where none)."""
    rows = sorted(timings)
    for i, n in enumerate(rows):
        if all(timings[m][1] < timings[m][0] for m in rows[i:]):
            return n
    return NEVER


def pass_threshold(per_format: dict[str, int]) -> int:
    """The rows from which a whole pass runs on tiles: the largest format threshold (NEVER if any is NEVER)."""
    values = list(per_format.values())
    if not values or NEVER in values:
        return NEVER
    return max(values)


def time_paths(run: Run, vnni_isa: int, other_isa: int = AMX_ISA, outputs: int = SIZE, calls: int = CALLS) -> Timer:
    """A timer of one format and row count on the VNNI path `vnni_isa` and on `other_isa` (tiles by default; the
    512-bit pairs for `native.wide_vnni_pays`), on an `outputs` x `SIZE` layer: best of `SWEEPS`, the two paths
    interleaved, seconds a call."""
    weights: dict[int, torch.Tensor] = {}
    names = {v: k for k, v in FORMATS.items()}

    def timer(fmt: int, rows: int) -> tuple[float, float]:
        if fmt not in weights:
            weights[fmt] = random_format(names[fmt], outputs, SIZE, torch.Generator().manual_seed(0))[0]
        x = torch.randn(rows, SIZE, generator=torch.Generator().manual_seed(rows))
        best = {vnni_isa: float("inf"), other_isa: float("inf")}
        for _ in range(SWEEPS):
            for isa in best:
                start = time.perf_counter()
                for _ in range(calls):
                    run(isa, x, weights[fmt], fmt)
                best[isa] = min(best[isa], time.perf_counter() - start)
        return best[vnni_isa] / calls, best[other_isa] / calls

    return timer


def measured_tile_rows(vnni_isa: int, timer: Timer, kernels_digest: str, *, cache_file: Path | None = None,
                       quiet: bool = False) -> int:
    """The rows from which passes run on AMX tiles on this machine (NEVER: not at all), timed once with `timer`
    and cached under the kernels' source digest, the VNNI path and the machine."""
    def measure() -> dict:
        per_format, ms = {}, {}
        for name, fmt in FORMATS.items():
            timings = {n: timer(fmt, n) for n in CANDIDATE_ROWS}
            per_format[name] = threshold(timings)
            ms[name] = {str(n): [round(1e3 * a, 4), round(1e3 * b, 4)] for n, (a, b) in timings.items()}
        return {"pass": pass_threshold(per_format), "formats": per_format, "vnni_amx_ms": ms}

    entry = measured_cache.once(
        cache_file or cache_path(), f"{kernels_digest}|vnni{vnni_isa}|{hardware.fingerprint('cpu')}",
        lambda e: isinstance(e, dict) and isinstance(e.get("pass"), int), measure,
        None if quiet else "stagedspec: timing AMX tiles against AVX-512 VNNI on this CPU (once; cached)...")
    return entry["pass"]


def forget_measured_tile_rows(cache_file: Path | None = None) -> None:
    """Drop the cached timings (`stagedspec tune` times the tiles again)."""
    measured_cache.forget(cache_file or cache_path())


def cache_path() -> Path:
    return learned_store() / "amx-rows.json"
