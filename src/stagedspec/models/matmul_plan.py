"""Which kernel each fp32 linear layer runs, by the pass's row count, as timed on this machine.

Why: a decoding pass multiplies a few rows by every weight matrix, and how
well a CPU's BLAS handles that shape is a property of the machine.  On an
AMD EPYC with AVX2 only (session 15, MKL 2024.2 in torch 2.13) PyTorch's
fp32 `F.linear` (x Wᵀ) ran the SmolLM2-135M oracle's pass in 77 ms for one
row, 129 ms for two and 178 ms for sixteen: its kernels for 2-16 rows
streamed the weights at a third of the bandwidth the one-row kernel reached,
so every multi-row verification cost as much as two or three tokens of
plain decoding and speculation could not pay.  The same product taken the
other way round, (W xᵀ)ᵀ, is a call with a long side of thousands of rows
and a short one of a few columns, which the library blocks well: two rows
then cost what one row costs, and a single row padded to two (the one-column
call takes the slow path again) beats the one-row kernel too.  Which way is
faster depends on the matrix's shape and the row count (on that CPU the
1536-wide down projection is faster the usual way for 2-12 rows and the
other way at 16), so nothing is hard-coded: `plan_matmuls` times both kernels
for every distinct weight shape of a model, streaming all the weights of
that shape as a pass does, at `PLAN_ROWS` row counts, once per machine
(cached beside the cost profiles; `stagedspec tune` times again), and each
layer runs the faster one for the row count at hand (`PlannedLinear`; the
output head through `Transformer.head_wxt_rows`).

Only fp32 weights on the CPU are planned: bf16 CPU kernels are either
native (oneDNN on AVX-512 BF16 and AMX, fast for a few rows) or convert per
row (AVX2, where the other order measured slower too), and `--bit-exact`
in bf16 relies on the usual kernel's rounding not depending on the row
count.  Quantised layers have kernels of their own.

Exactness: both kernels compute every output as a dot product in fp32;
they round differently (about 1e-5 relative), as the one-row and the
several-row kernels of `F.linear` already did.  Greedy fp32 output stays
the oracle's: the real-model fp32 test compares every method with `ar`
token by token, and the planned-kernel tests force each kernel at every
row count.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stagedspec import measured_cache

PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a decoding pass, a tree, a lookup chain; above: as is
MARGIN = 0.9  # (W xᵀ)ᵀ must be at least 10% faster to be chosen (timing noise; never slower than the default)
REPEATS = 3  # timed sweeps per kernel and row count (fastest kept), after one warm-up sweep ...
MIN_TIMED_SECONDS = 0.02  # ... and more for weights that fit in the caches (a draft's), whose sweeps are short
OFF_ENV = "STAGEDSPEC_MATMUL_PLAN"  # "off": every layer runs F.linear (a reference for comparisons)

RowPlan = tuple[bool, ...]  # index: a pass's row count (0..PLAN_ROWS[-1]); True: run (W xᵀ)ᵀ


def wxt_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ (+ b), computed as (W xᵀ)ᵀ; a single row is padded to two (the one-column product is slow)."""
    k = weight.shape[1]
    rows = x.reshape(-1, k)
    cols = torch.cat((rows, rows)).t() if rows.shape[0] == 1 else rows.t()
    y = torch.mm(weight, cols) if bias is None else torch.addmm(bias.unsqueeze(1), weight, cols)
    return y[:, : rows.shape[0]].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def planned_linear(x: Tensor, weight: Tensor, bias: Tensor | None, plan: RowPlan) -> Tensor:
    """x Wᵀ (+ b) by the kernel `plan` picks for this many rows (`F.linear` beyond the plan)."""
    rows = x.numel() // weight.shape[1]
    if rows < len(plan) and plan[rows]:
        return wxt_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class PlannedLinear(nn.Linear):
    """An `nn.Linear` that runs the kernel its row plan picks for each pass.

    Made from an existing layer by `plan_matmuls` (its class is switched, so
    its parameters, their names and anything sharing them stay as they are).
    """

    wxt_rows: RowPlan = ()

    def forward(self, x: Tensor) -> Tensor:
        return planned_linear(x, self.weight, self.bias, self.wxt_rows)


def expand_plan(chosen: dict[int, bool]) -> RowPlan:
    """A plan for every row count up to the largest measured one: each takes the choice measured at the
    smallest measured count at or above it (5 rows run as 6 were timed)."""
    measured = sorted(chosen)
    plan = [False]
    for rows in range(1, measured[-1] + 1):
        plan.append(chosen[next(m for m in measured if m >= rows)])
    return tuple(plan)


def weight_groups(model: nn.Module) -> dict[tuple[int, int], list[Tensor]]:
    """The model's fp32 weight matrices by shape: every linear layer's, and the output head's (which
    `Transformer._head` multiplies directly, whether it is the embedding, an untied head or a draft's own)."""
    head = _head_weight(model)
    groups: dict[tuple[int, int], list[Tensor]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not head and module.weight.dtype == torch.float32:
            groups.setdefault(tuple(module.weight.shape), []).append(module.weight)
    if head is not None and head.dtype == torch.float32:
        groups.setdefault(tuple(head.shape), []).append(head)
    return groups


def _head_weight(model: nn.Module) -> Tensor | None:
    if getattr(model, "head_q", None) is not None:
        return None  # a quantised head runs its own kernel
    return getattr(model, "head_weight", None)


Measure = Callable[[Sequence[Tensor], Sequence[int]], dict[int, tuple[float, float]]]


def time_kernels(weights: Sequence[Tensor], rows: Sequence[int] = PLAN_ROWS,
                 repeats: int = REPEATS) -> dict[int, tuple[float, float]]:
    """Seconds to multiply n rows by each of `weights` in turn (as a pass streams them), per row count:
    (`F.linear`, `wxt_linear`), the fastest of `repeats` sweeps, the two kernels interleaved."""
    k = weights[0].shape[1]
    gen = torch.Generator().manual_seed(0)
    kernels = (F.linear, wxt_linear)
    out: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, k, generator=gen)
            best = [float("inf")] * len(kernels)
            sweeps, sweep = repeats, 0
            while sweep <= sweeps:
                for i, kernel in enumerate(kernels):
                    start = time.perf_counter()
                    for w in weights:
                        kernel(x, w)
                    took = time.perf_counter() - start
                    if sweep:  # the first sweep warms caches and allocators
                        best[i] = min(best[i], took)
                    else:
                        sweeps = max(sweeps, min(25, int(MIN_TIMED_SECONDS / max(took, 1e-6))))
                sweep += 1
            out[n] = (best[0], best[1])
    return out


def choose(timings: dict[int, tuple[float, float]]) -> dict[int, bool]:
    """Per measured row count: whether (W xᵀ)ᵀ was at least `MARGIN` faster than `F.linear`."""
    return {n: wxt < MARGIN * plain for n, (plain, wxt) in timings.items()}


def planned(model: nn.Module) -> bool:
    """Whether `plan_matmuls` applies to this model: fp32 weights on the CPU, not switched off."""
    p = model.embed.weight
    return (p.device.type == "cpu" and p.dtype == torch.float32
            and os.environ.get(OFF_ENV, "").lower() not in ("off", "0", "no", "false"))


def plan_matmuls(model: nn.Module, *, measure: Measure | None = None, cache_file: Path | None = None,
                 quiet: bool = False) -> nn.Module:
    """Give every fp32 linear layer of `model` (and its output head) the faster kernel per row count, in place.

    Timings come from `cache_file` (default: `matmul-plan.json` in the cost-profile folder), keyed by the
    weight shape, how many weights share it, and the machine; shapes not timed yet are timed now with
    `measure` (default `time_kernels`), a few seconds for a 135M model.  The model gets
    `matmul_plan_signature` (part of its cost-profile key: its passes' costs depend on the plan).
    A model `planned` rules out is returned untouched.
    """
    from stagedspec import hardware

    if not planned(model):
        return model
    path = cache_file or _cache_file()
    data = measured_cache.read(path)
    machine = hardware.fingerprint("cpu")
    plans: dict[tuple[int, int], RowPlan] = {}
    new = False
    for shape, weights in weight_groups(model).items():
        key = f"fp32|{shape[0]}x{shape[1]}x{len(weights)}|{machine}"
        entry = data.get(key)
        if not _valid(entry):
            if not new and not quiet:
                print("stagedspec: timing this machine's fp32 matrix kernels (once; cached)...",
                      file=sys.stderr, flush=True)
            new = True
            timings = (measure or time_kernels)(weights, PLAN_ROWS)
            entry = {"wxt_rows": [n for n, yes in sorted(choose(timings).items()) if yes],
                     "linear_ms": {str(n): round(1e3 * t[0], 4) for n, t in sorted(timings.items())},
                     "wxt_ms": {str(n): round(1e3 * t[1], 4) for n, t in sorted(timings.items())}}
            data[key] = entry
        chosen = set(entry["wxt_rows"])
        plans[shape] = expand_plan({n: n in chosen for n in PLAN_ROWS})
    if new:
        measured_cache.write(path, data)
    apply_plan(model, plans)
    return model


def apply_plan(model: nn.Module, plans: dict[tuple[int, int], RowPlan]) -> None:
    """Switch the model's linear layers to `PlannedLinear` with the plan of their shape, and set the head's."""
    head = _head_weight(model)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not head and tuple(module.weight.shape) in plans:
            module.__class__ = PlannedLinear
            module.wxt_rows = plans[tuple(module.weight.shape)]
    if head is not None and tuple(head.shape) in plans:
        model.head_wxt_rows = plans[tuple(head.shape)]
    signature = repr(sorted((shape, tuple(i for i, yes in enumerate(p) if yes)) for shape, p in plans.items()))
    model.matmul_plan_signature = hashlib.sha256(signature.encode()).hexdigest()[:12]


def describe(model: nn.Module) -> list[str]:
    """One line per planned weight shape: the row counts that run (W xᵀ)ᵀ (for `stagedspec tune`)."""
    lines = []
    seen: set[tuple[int, int]] = set()
    head = _head_weight(model)
    for module in model.modules():
        if isinstance(module, PlannedLinear) and tuple(module.weight.shape) not in seen:
            seen.add(tuple(module.weight.shape))
            lines.append(_line(tuple(module.weight.shape), module.wxt_rows))
    plan = getattr(model, "head_wxt_rows", None)
    if head is not None and plan is not None and tuple(head.shape) not in seen:
        lines.append(_line(tuple(head.shape), plan) + " (output head)")
    return lines


def _line(shape: tuple[int, int], plan: RowPlan) -> str:
    rows = [n for n in PLAN_ROWS if n < len(plan) and plan[n]]
    which = ", ".join(map(str, rows)) if rows else "none"
    return f"{shape[0]}x{shape[1]}: (W x^T)^T at {which} of {', '.join(map(str, PLAN_ROWS))} rows"


def forget_measured_plans(cache_file: Path | None = None) -> None:
    """Drop the cached kernel timings (`stagedspec tune` re-times everything)."""
    measured_cache.forget(cache_file or _cache_file())


def _cache_file() -> Path:
    from stagedspec.models.default import cache_root

    return cache_root() / "costs" / "matmul-plan.json"


def _valid(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("wxt_rows"), list) and all(
        isinstance(n, int) for n in entry["wxt_rows"])
