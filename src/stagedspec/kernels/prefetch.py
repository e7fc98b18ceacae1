"""How far ahead the native tiles prefetch the weights they stream: timed once per machine and kernels, kept
beside the cost profiles.

Why measured: a one-row pass reads every weight once, so its speed is the memory's, and the tiles keep the
memory busy by asking for the bytes `distance` ahead of the ones they read (`prefetch_ahead` in
`qlinear.cpp`).  Too short a distance and each thread waits on memory latency; how far is far enough is the
machine's latency times its bandwidth, which differs between CPUs and VMs.  4 KB was chosen on an AVX2 EPYC;
on a Zen 4 EPYC (2 threads, 2026-12-07) the Qwen2.5-Coder-1.5B oracle's one-row pass took 0.92x the time at
8 KB, timed in one process against 4 KB (docs/kernels.md, "Weights on 2 MB pages").

What is timed: one-row calls over `MATRICES` copies of a Q4_K layer, 145 MB in all (more than the last level
cache a small VM gets, so the weights come from memory as a real pass's do), on 2 MB pages where the model's
weights get them (`kernels.huge_pages`), each candidate distance in turn, best of `SWEEPS` interleaved sweeps:
about 0.3 s, once.  The results never depend on the distance, only the speed, so the choice is free to differ
between machines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from stagedspec import hardware, measured_cache
from stagedspec.kernels.huge_pages import huge_page_arena
from stagedspec.kernels.packing import FORMATS, random_format
from stagedspec.paths import learned_store

CANDIDATES = (4096, 8192, 16384)  # bytes ahead; the first is the kernels' own default
DEFAULT = CANDIDATES[0]
GAIN = 1.03  # the least speedup over the default that moves the distance (timing noise stays at the default)
NEAR = 1.02  # distances this close to the fastest count as fast as it
OUTPUTS, INPUTS = 4096, 1536  # one Q4_K layer of 3.6 MB
MATRICES = 40  # 145 MB streamed a sweep
SWEEPS = 5

# a setting (the distance) -> seconds of one sweep (calls over every matrix)
Sweep = Callable[..., float]  # (value, rows=1, setting=prefetch_ahead) -> seconds


def choose(seconds: dict[int, float]) -> int:
    """The shortest distance within `NEAR` of the fastest, if that beats the default by `GAIN`; else the default.
    The shortest because a call's last `distance` bytes of prefetches fall past its weights, wasted."""
    fastest = min(seconds.values())
    best = min(d for d, s in seconds.items() if s <= NEAR * fastest)
    return best if seconds[DEFAULT] >= GAIN * seconds[best] else DEFAULT


def stream_sweep(kernels: object) -> Sweep:
    """A sweep timer over `MATRICES` distinct copies of one random Q4_K layer, read `rows` rows a call (one by
    default), with `setting` (default: the prefetch distance, `prefetch_ahead`) set to the sweep's value before
    it (`kernels`: a `NativeKernels`).  The copies are made at the first sweep, so a timing found in the cache
    costs nothing, and one set serves every setting timed (`kernels.pair_rows` times the pairing on them)."""
    copies: list[torch.Tensor] = []
    inputs: dict[int, torch.Tensor] = {}
    fmt = FORMATS["q4_k"]

    def sweep(value: int, rows: int = 1, setting: Callable[[int], object] | None = None) -> float:
        if not copies:
            packed, _ = random_format("q4_k", OUTPUTS, INPUTS, torch.Generator().manual_seed(0))
            # distinct addresses, none in cache when read, on the pages a model's weights get (`huge_pages`)
            arena = huge_page_arena(MATRICES * packed.numel())
            copies.extend(arena[i * packed.numel():(i + 1) * packed.numel()] for i in range(MATRICES))
            for c in copies:
                c.copy_(packed)
        x = inputs.get(rows)
        if x is None:
            x = inputs[rows] = torch.randn(rows, INPUTS, generator=torch.Generator().manual_seed(1))
        (setting or torch.ops.stagedspec_qlinear.prefetch_ahead)(value)
        start = time.perf_counter()
        for w in copies:
            kernels.qlinear(x, w, [fmt], [OUTPUTS])  # type: ignore[attr-defined]
        return time.perf_counter() - start

    return sweep


def measured_distance(sweep: Sweep, kernels_digest: str, *, cache_file: Path | None = None,
                      quiet: bool = False) -> int:
    """The prefetch distance for this machine, timed once with `sweep` and cached under the kernels' source
    digest and the machine."""
    def measure() -> dict:
        sweep(DEFAULT)  # first touch of every copy, untimed
        best = {d: float("inf") for d in CANDIDATES}
        for _ in range(SWEEPS):
            for d in best:
                best[d] = min(best[d], sweep(d))
        return {"distance": choose(best), "sweep_ms": {str(d): round(1e3 * s, 3) for d, s in best.items()}}

    entry = measured_cache.once(
        cache_file or cache_path(), f"{kernels_digest}|{hardware.fingerprint('cpu')}",
        lambda e: isinstance(e, dict) and e.get("distance") in CANDIDATES, measure,
        None if quiet else "stagedspec: timing the weights' prefetch distance on this CPU (once; cached)...")
    return int(entry["distance"])


def forget_measured_distance(cache_file: Path | None = None) -> None:
    """Drop the cached timing (`stagedspec tune` times it again)."""
    measured_cache.forget(cache_file or cache_path())


def cache_path() -> Path:
    return learned_store() / "prefetch.json"
