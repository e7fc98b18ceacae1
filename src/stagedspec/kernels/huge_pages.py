"""A loaded model's packed weights moved into memory backed by 2 MB pages, where the kernel gives them.

Why: a one-row pass streams every weight once, a gigabyte for Qwen2.5-Coder-1.5B, and read through 4 KB pages
every 4 KB of it misses the TLB: the stream waits on page walks as well as on memory.  On a Zen 4 EPYC (2 threads,
2026-12-07) 145 MB of Q4_K tiles read a row at a time streamed at 23.8 GB/s from 4 KB pages and 27.9 GB/s
from 2 MB pages; with the tiles prefetching further ahead too (`kernels.prefetch`), the Qwen oracle's one-row pass
took 0.86x the time and `ar` ran 1.25-1.30x as fast (docs/kernels.md, "Weights on 2 MB pages").  Linux gives
anonymous memory 2 MB pages where `madvise(MADV_HUGEPAGE)` asks for them, unless transparent huge pages are
switched off (`/sys/kernel/mm/transparent_hugepage/enabled` says `[never]`).

What moves: the native kernels' packed weights (uint8 storages: int4, int8 and the GGUF formats kept exactly), the
bytes every pass streams.  The embedding table (a gather of a few rows a pass) and the norms stay.

How: the storages are copied, one after another, into one anonymous mapping advised for huge pages, and
every tensor that viewed an old storage is pointed at its copy in place (`Tensor.set_`), so the lists of
tensors the native layer stacks hold see the move.  The values are the same bytes, so outputs cannot change.
Where huge pages are unavailable, or on a platform without `madvise`, nothing moves.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PAGE = 2 << 20  # the mapping's start is aligned to a huge page
ALIGN = 4096  # each storage's start within it
MIN_BYTES = 64 << 10  # storages smaller than this stay where they are (a few pages in all)


def huge_pages_available() -> bool:
    """Whether `madvise(MADV_HUGEPAGE)` can give this process 2 MB pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SWITCH.read_text()
    except OSError:
        return False


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers, and tensors (or lists and tuples of them) kept as
    plain attributes, such as the packed weights of the native layers."""
    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            found[id(t)] = t
        for value in vars(m).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for t in items:
                if isinstance(t, torch.Tensor):
                    found[id(t)] = t
    return list(found.values())


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy `module`'s packed weights (CPU uint8 storages of `MIN_BYTES` or more) into one mapping advised for
    2 MB pages and point their tensors there; returns the bytes moved (0: nothing moved).  The mapping lives as
    long as the tensors that view it."""
    if not huge_pages_available():
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for t in _tensors(module):
        if t.device.type != "cpu" or t.dtype != torch.uint8 or t.is_sparse:
            continue
        s = t.untyped_storage()
        if s.nbytes() < MIN_BYTES:
            continue
        by_storage.setdefault(s.data_ptr(), []).append(t)
        storages[s.data_ptr()] = s
    if not storages:
        return 0
    offsets, total = {}, 0
    for ptr, s in storages.items():
        offsets[ptr] = total
        total += (s.nbytes() + ALIGN - 1) // ALIGN * ALIGN
    arena = huge_page_arena(total)
    target = arena.untyped_storage()
    start = arena.storage_offset()  # offsets into `target` count from the mapping's start
    with torch.no_grad():
        for ptr, s in storages.items():
            at = offsets[ptr]
            arena[at:at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
            for t in by_storage[ptr]:
                item = t.element_size()
                t.set_(target, (start + at + t.storage_offset() * item) // item, t.size(), t.stride())
    return total


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh zeroed memory as a uint8 tensor starting on a 2 MB boundary, advised for 2 MB pages
    (plain pages where `huge_pages_available` is False).  The mapping lives as long as tensors view it."""
    arena_map = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        arena_map.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(arena_map, dtype=torch.uint8)  # its storage holds `arena_map` alive
    start = (-whole.data_ptr()) % PAGE  # the first huge page boundary
    return whole[start:start + nbytes]
