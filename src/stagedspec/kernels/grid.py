"""Choose the int4/int8 codes of a float weight, keeping a GGUF group's own codes where it sits on an even grid.

Why apart from `packing`: the grid scan runs on the native kernels where they
are built (`native.NativeKernels.grid_groups`, from `grid.cpp`), and the
native kernels' self-check uses `packing`'s random layouts; with the scan in
`packing`, those two modules would each import the other.  Here it sits
above both: `packing` only lays codes out, `native` builds and checks the
kernels, and this module decides the codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stagedspec.kernels.native import native_kernels
from stagedspec.kernels.packing import GROUP


def grid_steps(w: Tensor, max_levels: int = 16) -> tuple[Tensor, Tensor, Tensor]:
    """`grid_steps_reference`, on the native scan where it is built (minutes become seconds on a 1.5B model)."""
    kernels = native_kernels(quiet=True)
    return kernels.grid_groups(w, max_levels) if kernels is not None else grid_steps_reference(w, max_levels)


def grid_steps_reference(w: Tensor, max_levels: int = 16) -> tuple[Tensor, Tensor, Tensor]:
    """Per group of 32: (low, step, levels) of the evenly spaced grid its values sit on, as found.

    A 4-bit GGUF group (Q4_0, Q4_1, Q4_K) is `scale * code + offset` for 16
    codes, computed in fp32.  Its step divides the smallest distance d of a
    value above the group's minimum: the first d / m (m = 1..15) on which
    every value lies a whole number of steps above the minimum, with at most
    16 levels from min to max.  `levels` counts those grid points (1 for a
    constant group), or is 0 where no such grid exists (bf16 or fp32 weights,
    or Q6_K's two scales per group); `step` is then (max - min) / 15.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    span = hi - lo
    above = g - lo[..., None]
    smallest = torch.where(above > 1e-5 * span[..., None], above, span[..., None]).amin(-1)
    step, levels = span / (max_levels - 1), torch.zeros_like(lo)
    for m in range(15, 0, -1):  # the smallest m that fits is written last
        s = smallest / m
        count = span / s
        pos = above / s[..., None]
        fits = ((pos - pos.round()).abs() < 1e-3).all(-1) & (count <= max_levels - 0.5)
        step = torch.where(fits, s, step)
        levels = torch.where(fits, count.round() + 1, levels)
    constant = ~(span > 0)
    return lo, torch.where(constant, torch.ones_like(step), step), torch.where(constant, torch.ones_like(levels), levels)


def four_bit_share(w: Tensor) -> float:
    """The share of `w`'s groups of 32 whose values sit on an even grid of at most 16 levels."""
    _, _, levels = grid_steps(w)
    return float(((levels >= 1) & (levels <= 16)).float().mean())


def int4_groups_from_float(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """int4 per group of 32: codes uint8 [N, K], scale and low fp16 [N, K/32] (weight = scale * code + low).

    A group already on an even grid of at most 16 levels (a 4-bit GGUF
    source) keeps its codes: the grid's own step and minimum become scale and
    low, rounded to fp16 (Q4_0 and Q4_1 store fp16, so theirs come back
    exactly; Q4_K's products of fp16 and 6-bit scales move by at most 2^-12
    relative).  Any other group is quantised by min/max, as Q4_1 is made.
    The codes are chosen against the fp16 values the kernel will use.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, step, levels = grid_steps(w)
    hi = g.amax(-1)
    own_grid = (levels >= 2) & (levels <= 16)
    scale = torch.where(own_grid, step, ((hi - lo) / 15.0)).clamp_min(1e-8).half()
    low = lo.half()
    codes = torch.round((g - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scale, low


def int8_groups_from_float(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per group of 32: codes int8 [N, K], scale fp16 [N, K/32] (weight = scale * code).

    A group already on an even grid through zero of at most 255 levels (a
    Q8_0 or Q5_0 source) keeps its codes, its step as the scale; any other
    group gets Q8_0's rule, scale = max |w| / 127.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, step, levels = grid_steps(w, 255)
    amax = g.abs().amax(-1)
    through_zero = ((lo / step) - (lo / step).round()).abs() < 1e-3
    own_grid = (levels >= 2) & through_zero & (amax / step <= 127.5)
    scale = torch.where(own_grid, step, amax / 127.0).clamp_min(1e-10).half()
    codes = torch.round(g / scale.float()[..., None]).clamp_(-127, 127)
    return codes.to(torch.int8).reshape(n, k), scale
