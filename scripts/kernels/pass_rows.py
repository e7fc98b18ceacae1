"""A whole pass of a real oracle by rows, on AMX tiles against AVX-512 VNNI, in one process, interleaved.

    python scripts/kernels/pass_rows.py [--oracle qwen2.5-coder-1.5b] [--repeats 3] [--prefill 1000] [--isas 2,3]

Why in one process: a VM's speed drifts 20-30% between processes, so each sweep times every row count on each
path in turn, and the best of the sweeps is kept.  Every module's kernels are switched between
`NativeKernels(vnni)` and `NativeKernels(4)` (the same bits; only the speed differs); `--isas` names other
paths to compare instead (`stagedspec.kernels.native.ISA_NAMES`: 2 the 256-bit VNNI tiles, 3 their 512-bit
pairs), the first of them the one the ratios are taken against.  `--prefill N` also times
one pass of an N-token prompt on an empty cache (the time to first token, less tokenising and sampling).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stagedspec.kernels.native import AMX_ISA, NativeKernels, native_kernels
from stagedspec.hardware import auto_dtype
from stagedspec.models.loading import load_model
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.quant import resolve_quant
from stagedspec.profiling import forward_cost_curve

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def switch(model: torch.nn.Module, kernels: NativeKernels) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), NativeKernels):
            module.kernels = kernels


def prefill_seconds(model, tokens: int) -> float:  # noqa: ANN001
    cache = model.new_cache(tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, torch.arange(tokens), cache, PassSpec(logits_rows=slice(-1, None)))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", default="qwen2.5-coder-1.5b")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved sweeps over both paths; the best is kept")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--isas", default=None, help="paths to compare, e.g. 2,3 (default: this CPU's VNNI and AMX)")
    args = ap.parse_args()
    best = native_kernels()
    assert best is not None
    dtype = torch.bfloat16 if auto_dtype("cpu")[0] == "bf16" else torch.float32  # as `--dtype auto` runs it
    model, _ = load_model(args.oracle, dtype=dtype, device="cpu", quant=resolve_quant("auto", args.oracle, "cpu"))
    if args.isas:
        paths = {f"isa{isa}": NativeKernels(int(isa)) for isa in args.isas.split(",")}
    else:
        paths = {"vnni": NativeKernels(best.isa), "amx": NativeKernels(AMX_ISA)}
    first = next(iter(paths))
    ms: dict[str, dict[int, float]] = {name: {} for name in paths}
    ttft: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, kernels in paths.items():
            switch(model, kernels)
            for n, sec in forward_cost_curve(model, ROWS, repeats=3).items():
                ms[name][n] = min(ms[name].get(n, 1e9), 1e3 * sec)
            if args.prefill:
                ttft[name] = min(ttft.get(name, 1e9), prefill_seconds(model, args.prefill))
    print(f"{args.oracle}, {torch.get_num_threads()} threads; ms by rows (x one row on {first})")
    for name in paths:
        print(f"{name:5s} " + " ".join(f"{n}:{ms[name][n]:.1f}({ms[name][n] / ms[first][1]:.2f}x)" for n in ROWS))
    if ttft:
        print("prefill of", args.prefill, "tokens:", {k: round(v, 3) for k, v in ttft.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"oracle": args.oracle, "ms": ms, "prefill_s": ttft, "prefill_tokens": args.prefill}, f, indent=1)


if __name__ == "__main__":
    main()
