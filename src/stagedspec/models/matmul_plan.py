"""Which kernel each fp32 linear layer runs, by the pass's row count, as timed on this machine.

Why: a decoding pass multiplies a few rows by every weight matrix, and how
well a CPU's BLAS handles that shape is a property of the machine.  On an
AMD EPYC with AVX2 only PyTorch's fp32 `F.linear` (x Wᵀ) streamed the
weights far more slowly in its kernels for a few rows than in its one-row
kernel, so every multi-row verification cost as much as several tokens of
plain decoding and speculation could not pay
(docs/measurements.md, "fp32 `F.linear` by row count on an AVX2 EPYC").  The same product taken the
other way round, (W xᵀ)ᵀ, is a call with a long side of thousands of rows
and a short one of a few columns, which the library blocks well: two rows
then cost what one row costs, and a single row padded to two (the one-column
call takes the slow path again) beats the one-row kernel too.  Which way is
faster depends on the matrix's shape and the row count (on that CPU one
shape was faster the usual way at some row counts and the other way at
others), so nothing is hard-coded: `plan_matmuls` times both kernels
for every distinct weight shape of a model, streaming all the weights of
that shape as a pass does, at `PLAN_ROWS` row counts, once per machine
(cached beside the cost profiles; `stagedspec tune` times again), and each
layer runs the faster one for the row count at hand (`PlannedLinear`; the
output head through `Transformer.runtime.head_row_plan`).

Row counts are a choice too.  Both kernels block the short side in groups,
so an odd count can cost more than the round one above it, and one row as
a one-column product takes the slow path where two rows do not
(docs/measurements.md, "Odd row counts against round ones on an AVX2 EPYC").  So the plan for n rows is
the fastest measured (kernel, m >= n rows) pair: the pass's rows padded with
repeats of its last row, whose outputs are dropped.  The cost curve the
`auto` policy prices trees with is measured through the plan, so it sees
the padded costs.

Only fp32 weights on the CPU are planned: bf16 CPU kernels are either
native (oneDNN on AVX-512 BF16 and AMX, fast for a few rows) or convert per
row (AVX2, where the other order measured slower too), and `--bit-exact`
in bf16 relies on the usual kernel's rounding not depending on the row
count.  Quantised layers have kernels of their own.

Exactness: both kernels compute every output as a dot product in fp32;
they round differently (about 1e-5 relative), as the one-row and the
several-row kernels of `F.linear` already did.  Greedy fp32 output stays
the oracle's: the real-model fp32 test compares every method with `ar`
token by token, and the planned-kernel tests force each kernel and padding
at every row count.  A padding row never meets a real one: the linear
layers are the only ops that see it, and they compute rows independently.
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

from stagedspec import hardware, measured_cache
from stagedspec.paths import learned_store

PLAN_ROWS = (*range(1, 17), 20, 24, 32, 48, 64)  # a decoding pass, a tree, a lookup chain; above: as is
MARGIN = 0.9  # another kernel or row count must be at least 10% faster to be chosen (timing noise)
REPEATS = 3  # timed sweeps per kernel and row count (fastest kept), after one warm-up sweep ...
MIN_TIMED_SECONDS = 0.02  # ... and more for weights that fit in the caches (a draft's), whose sweeps are short
OFF_ENV = "STAGEDSPEC_MATMUL_PLAN"  # "off": every layer runs F.linear (a reference for comparisons)
FORMAT = "fp32v2"  # cache key prefix: v2 plans pad rows (v1 entries, kernel choice only, are timed again)

Step = tuple[bool, int]  # (run (W xᵀ)ᵀ, rows to run the product over: the real ones, then repeats of the last)
RowPlan = tuple[Step, ...]  # index: a pass's row count (0..PLAN_ROWS[-1])


def wxt_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ (+ b), computed as (W xᵀ)ᵀ."""
    k = weight.shape[1]
    rows = x.reshape(-1, k)
    y = torch.mm(weight, rows.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.t())
    return y.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def planned_linear(x: Tensor, weight: Tensor, bias: Tensor | None, plan: RowPlan) -> Tensor:
    """x Wᵀ (+ b) by the kernel and padded row count `plan` picks for this many rows (`F.linear` beyond it).

    Padding rows repeat the last real row (finite values) and their outputs are dropped: every real row's
    output is its own dot products, whichever rows ran beside it."""
    k = weight.shape[1]
    rows = x.numel() // k
    if rows >= len(plan):
        return F.linear(x, weight, bias)
    wxt, run_rows = plan[rows]
    kernel = wxt_linear if wxt else F.linear
    if run_rows == rows:
        return kernel(x, weight, bias)
    flat = x.reshape(rows, k)
    padded = torch.cat((flat, flat[-1:].expand(run_rows - rows, k)))
    return kernel(padded, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])


class PlannedLinear(nn.Linear):
    """An `nn.Linear` that runs the kernel and row count its plan picks for each pass.

    Made from an existing layer by `plan_matmuls` (its class is switched, so
    its parameters, their names and anything sharing them stay as they are).
    """

    row_plan: RowPlan = ()

    def forward(self, x: Tensor) -> Tensor:
        return planned_linear(x, self.weight, self.bias, self.row_plan)


def expand_plan(chosen: dict[int, Step]) -> RowPlan:
    """A plan for every row count up to the largest measured one.  A measured count runs its choice; one
    between measured counts runs as the next measured count does, padded to it (every pass runs a timed
    shape: 17 rows run as 20 were timed)."""
    measured = sorted(chosen)
    plan: list[Step] = [(False, 0)]
    for rows in range(1, measured[-1] + 1):
        wxt, run_rows = chosen[next(m for m in measured if m >= rows)]
        plan.append((wxt, max(rows, run_rows)))
    return tuple(plan)


def weight_groups(model: nn.Module) -> dict[tuple[int, int], list[Tensor]]:
    """The model's fp32 weight matrices by shape: every linear layer's, and the output head's (which
    `Transformer.head_logits` multiplies directly, whether it is the embedding, an untied head or a draft's own)."""
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


def choose(timings: dict[int, tuple[float, float]]) -> dict[int, Step]:
    """Per measured row count n: the fastest (kernel, m >= n measured rows) by the timings, if at least
    `MARGIN` faster than `F.linear` over the n rows; else `F.linear` over n.  (W xᵀ)ᵀ often wins
    outright, and both kernels are often faster for a round count than for the odd one below it
    (docs/measurements.md, "Odd row counts against round ones on an AVX2 EPYC"), so a pass pads up to it."""
    out: dict[int, Step] = {}
    for n, (plain, _) in timings.items():
        seconds, step = min((t[i], (i == 1, m)) for m, t in timings.items() if m >= n for i in (0, 1))
        out[n] = step if seconds < MARGIN * plain else (False, n)
    return out


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
    `runtime.matmul_plan_signature` (part of its cost-profile key: its passes' costs depend on the plan).
    A model `planned` rules out is returned untouched.
    """
    if not planned(model):
        return model
    path = cache_file or _cache_file()
    data = measured_cache.read(path)
    machine = hardware.fingerprint("cpu")
    plans: dict[tuple[int, int], RowPlan] = {}
    new = False
    for shape, weights in weight_groups(model).items():
        key = f"{FORMAT}|{shape[0]}x{shape[1]}x{len(weights)}|{machine}"
        entry = data.get(key)
        if not _valid(entry):
            if not new and not quiet:
                print("stagedspec: timing this machine's fp32 matrix kernels (once; cached)...",
                      file=sys.stderr, flush=True)
            new = True
            timings = (measure or time_kernels)(weights, PLAN_ROWS)
            entry = {"plan": {str(n): list(step) for n, step in sorted(choose(timings).items())},
                     "linear_ms": {str(n): round(1e3 * t[0], 4) for n, t in sorted(timings.items())},
                     "wxt_ms": {str(n): round(1e3 * t[1], 4) for n, t in sorted(timings.items())}}
            data[key] = entry
        plans[shape] = expand_plan({int(n): (bool(wxt), int(m)) for n, (wxt, m) in entry["plan"].items()})
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
            module.row_plan = plans[tuple(module.weight.shape)]
    if head is not None and tuple(head.shape) in plans:
        model.runtime.head_row_plan = plans[tuple(head.shape)]
    signature = repr(sorted(plans.items()))
    model.runtime.matmul_plan_signature = hashlib.sha256(signature.encode()).hexdigest()[:12]


def describe(model: nn.Module) -> list[str]:
    """One line per planned weight shape, each measured row count as `n:K[m]` (for `stagedspec tune`): K is
    W for (W xᵀ)ᵀ, L for `F.linear` (x Wᵀ); m, when there, the rows the product runs over (padded)."""
    lines = []
    seen: set[tuple[int, int]] = set()
    head = _head_weight(model)
    for module in model.modules():
        if isinstance(module, PlannedLinear) and tuple(module.weight.shape) not in seen:
            seen.add(tuple(module.weight.shape))
            lines.append(_line(tuple(module.weight.shape), module.row_plan))
    plan = model.runtime.head_row_plan
    if head is not None and plan is not None and tuple(head.shape) not in seen:
        lines.append(_line(tuple(head.shape), plan) + " (output head)")
    return lines


def _line(shape: tuple[int, int], plan: RowPlan) -> str:
    steps = [f"{n}:{'W' if wxt else 'L'}{m if m != n else ''}" for n, (wxt, m) in enumerate(plan)
             if n in PLAN_ROWS]
    return f"{shape[0]}x{shape[1]}: " + " ".join(steps)


def forget_measured_plans(cache_file: Path | None = None) -> None:
    """Drop the cached kernel timings (`stagedspec tune` re-times everything)."""
    measured_cache.forget(cache_file or _cache_file())


def _cache_file() -> Path:
    return learned_store() / "matmul-plan.json"


def _valid(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("plan"), dict) or not entry["plan"]:
        return False
    try:
        return all(int(n) > 0 and int(m) >= int(n) and isinstance(wxt, bool)
                   for n, (wxt, m) in entry["plan"].items())
    except (TypeError, ValueError):
        return False
