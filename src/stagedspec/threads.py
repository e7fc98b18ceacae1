"""How many threads to decode with: what this process may use, less what other processes are using right now.

Why: every native kernel call is an OpenMP parallel region whose threads meet
at a barrier.  When another process keeps one of a 2-core machine's cores
busy, a region waits for its descheduled thread a whole scheduler time slice,
and a pass on both threads took many times as long as on one
(docs/measurements.md, "A pass on both threads beside a busy process on an AVX2 EPYC").
So the thread count follows the machine: `ThreadGovernor` reads
the CPUs' busy time (`/proc/stat`) and this process's own CPU time every
quarter second and sets PyTorch's thread count to the CPUs the others leave
free.  No trial passes are needed, so an idle machine pays nothing.

Only models whose results do not depend on the thread count may change it
mid-run: the native kernels are bit-identical for any thread count
(tested); PyTorch's own kernels may split a reduction differently.  The
pipeline therefore governs a quantised model on the native kernels and keeps
a fixed count otherwise (`--threads N` fixes it always).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from stagedspec.models.quant import kernel_name

INTERVAL_SECONDS = 0.25  # how often the machine's load is read (each read is a few tens of microseconds)
SPARE_CPU = 0.5  # a CPU counts as free when other processes use less than this share of it


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), or 0..n-1 where the platform does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_busy_seconds(cpus: list[int], path: str = "/proc/stat") -> float | None:
    """Seconds the given CPUs have spent busy (not idle, not waiting on I/O) since boot; None off Linux."""
    try:
        with open(path, encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    ticks = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in parts[1:9])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Keeps `torch.set_num_threads` at the number of allowed CPUs other processes leave free.

    `tick()` is called between decoding steps; at most every `interval`
    seconds it compares the CPUs' busy time with this process's CPU time
    over the last interval.  `busy` and `clock` are injectable for tests.
    """

    def __init__(self, max_threads: int | None = None, interval: float = INTERVAL_SECONDS,
                 busy: Callable[[list[int]], float | None] = read_busy_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = time.process_time) -> None:
        self.cpus = allowed_cpus()
        self.max_threads = max(1, min(max_threads or len(self.cpus), len(self.cpus)))
        self.interval, self._busy, self._clock, self._own = interval, busy, clock, own_cpu
        self.threads = self.max_threads
        self.changes = 0
        torch.set_num_threads(self.threads)
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy(self.cpus)
        return None if busy is None else (self._clock(), busy, self._own())

    def others_load(self) -> float | None:
        """CPUs' worth of work other processes did since the last reading (None: not measurable here)."""
        now = self._sample()
        if now is None or self._mark is None:
            return None
        wall = now[0] - self._mark[0]
        if wall <= 0:
            return None
        others = (now[1] - self._mark[1]) - (now[2] - self._mark[2])
        self._mark = now
        return max(0.0, others / wall)

    def tick(self) -> int:
        """Re-read the load when an interval has passed and set the thread count; returns the count in use."""
        if self._mark is None or self._clock() - self._mark[0] < self.interval:
            return self.threads
        load = self.others_load()
        if load is None:
            return self.threads
        free = len(self.cpus) - load
        want = max(1, min(self.max_threads, int(free + SPARE_CPU)))
        if want != self.threads:
            self.threads = want
            self.changes += 1
            torch.set_num_threads(want)
        return self.threads


def no_parallel_regions_here() -> bool:
    """Make the calling thread run its PyTorch operations on itself alone; returns whether that took effect.

    Why: GNU OpenMP gives every thread that opens a parallel region a pool of workers of its own, and once the
    process holds more such threads than it has CPUs, every pool's workers stop spinning between regions and
    sleep (libgomp's throttled spin count).  A pass is ~100 regions (a native kernel call each), so each then
    pays a futex wake-up and a sleeping barrier.  After one server request, whose lane thread had opened
    regions in small operations (argmax over the vocabulary), `ar` decoding on the scheduler's thread ran far
    slower, and stayed there (docs/measurements.md, "OpenMP pools of a server lane thread on a Zen 4 EPYC").  A thread
    that only does such small work (a server lane) calls this at its start, so the process keeps one pool.

    PyTorch sets a thread's OpenMP thread count from its global one at the thread's first parallel call, so
    that is triggered first; then the thread's own count (an OpenMP per-thread setting) is set to 1 through
    libgomp, which leaves every other thread's count and PyTorch's global one as they are.  Where the OpenMP
    runtime is not libgomp's (or absent), nothing changes.
    """
    import ctypes

    torch.get_num_threads()  # PyTorch's per-thread initialisation, which would otherwise undo the setting below
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return False
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)
    return torch.get_num_threads() == 1


def governor_for(model: torch.nn.Module, setting: str | int = "auto") -> ThreadGovernor | None:
    """The thread policy for a run of `model`: `setting` = N fixes N threads (None comes back); "auto" gives a
    `ThreadGovernor` capped at PyTorch's current count where the model's results cannot depend on the count
    (its layers on the native kernels), and leaves the count alone otherwise."""
    if setting != "auto":
        torch.set_num_threads(max(1, int(setting)))
        return None
    if not kernel_name(model).startswith("stagedspec-native"):
        return None
    return ThreadGovernor(max_threads=torch.get_num_threads())
