"""Each native weight format's multi-row cost as a fraction of this CPU's int8 arithmetic floor.

    python scripts/kernels/floor.py [--threads 2] [--rows 1,4,8,16,64] [--isas 2,3] [--json OUT]

The floor: a pass of R rows over an N x K matrix is R*N*K int8 multiply-adds; at the rate a path's integer
instruction retires on this CPU (measured here by `peak.cpp`, each thread running independent chains) it takes
at least R*N*K / peak seconds.  Each path is reported against its own instruction's floor (AVX2: `vpmaddubsw`
+ `vpaddw`; AVX-512 VNNI: 256-bit `vpdpbusd`; its 512-bit pairs of tiles: 512-bit `vpdpbusd`) and against the
best this CPU has: cores that run 512-bit operations whole (Zen 5, Intel's server cores; not Zen 4) retire
twice the multiply-adds with 512-bit `vpdpbusd` at the same instruction rate.

Each format is timed on one 1536 x 1536 matrix held in cache (the rows' arithmetic, not memory, is what grows
with the rows), as the best of 7 sweeps of 48 calls; one row streamed from memory (48 copies, about 70 MB in
int4) gives the read rate beside it.  Every instruction-set path asked for (`--isas`, default: the path this
CPU loads, and on AVX-512 VNNI both the 256-bit tiles and their 512-bit pairs) is timed in turn on each
format and row count, so the paths are compared in one run.  Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stagedspec.kernels.native import ISA_NAMES, cpu_isa, native_kernels
from stagedspec.kernels.packing import BITS_PER_WEIGHT, FORMATS, random_format

PEAK_ROUNDS = 20_000_000  # about 30 ms a call: long enough that waking the threads does not count


def best_of(fn, reps: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_rate(kernels, width: int, threads: int) -> float | None:  # noqa: ANN001
    """Multiply-adds a second of `width`-bit int8 dot products on `threads` threads (None: not on this CPU)."""
    if kernels.int8_peak(width, 1000, threads) is None:
        return None
    seconds = best_of(lambda: kernels.int8_peak(width, PEAK_ROUNDS, threads), 5)
    return threads * PEAK_ROUNDS * kernels.int8_peak_chains() * width / 8 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,64")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--isas", default=None, help="instruction-set paths to time, by number (native.ISA_NAMES)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native_kernels()
    runs = cpu_isa()
    if kernels is None or runs is None:
        raise SystemExit("the native kernels are unavailable on this machine")
    isas = ([int(i) for i in args.isas.split(",")] if args.isas else
            sorted({kernels.isa} | ({2, 3} if runs == 3 else set())))
    if any(i < 1 or i > runs for i in isas):
        raise SystemExit(f"--isas: this CPU runs paths 1..{runs} with an int8 instruction")
    rows = [int(r) for r in args.rows.split(",")]
    # each path's own instruction: AVX2 `vpmaddubsw` + `vpaddw`, VNNI `vpdpbusd` of 256 or 512 bits
    own = {1: (1, 256), 2: (2, 256), 3: (3, 512)}  # path: (path, width)
    peaks = {i: peak_rate(kernels.with_isa(i), width, args.threads) for i, (_, width) in own.items() if i <= runs}
    if not peaks:
        raise SystemExit(f"no int8 dot-product instruction on the {ISA_NAMES[runs]} path")
    best = max(peaks.values())
    print(f"loaded: {kernels.name}; {args.threads} threads; int8 multiply-adds a second at peak: "
          + ", ".join(f"{ISA_NAMES[i]} {p / 1e9:.0f} G" for i, p in peaks.items() if p))
    n = k = 1536
    report = {"loaded": ISA_NAMES[kernels.isa], "threads": args.threads,
              "peak_multiply_adds_per_second": {ISA_NAMES[i]: p for i, p in peaks.items()},
              "shape": [n, k], "paths": {ISA_NAMES[i]: {} for i in isas}}
    print("ms per call (fraction of the path's own floor / of this CPU's best); one row streamed: ms and GB/s")
    print("format | path | one row streamed | " + " | ".join(f"{r} rows" for r in rows))
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        weight, _ = random_format(name, n, k, torch.Generator().manual_seed(0))
        streamed, cached = [weight.clone() for _ in range(48)], [weight] * 48
        xs = {r: torch.randn(r, k) for r in rows}
        timings: dict[int, dict] = {i: {"rows": {}} for i in isas}
        for r in [0, *rows]:  # 0: one row streamed
            for isa in isas:  # the paths in turn at each row count
                path = kernels.with_isa(isa)
                mats, x = (streamed, xs.get(1, torch.randn(1, k))) if r == 0 else (cached, xs[r])

                def sweep(path=path, mats=mats, x=x) -> None:  # noqa: ANN001
                    for m in mats:
                        path.qlinear(x, m, [fmt], [n])

                sweep()
                t = best_of(sweep, 7) / len(mats)
                if r == 0:
                    timings[isa]["streamed_one_row_ms"] = t * 1e3
                    timings[isa]["streamed_gb_s"] = n * k * BITS_PER_WEIGHT[name] / 8 / t / 1e9
                else:
                    rate = r * n * k / t
                    timings[isa]["rows"][str(r)] = {"ms": t * 1e3, "fraction_of_own_floor": rate / peaks[isa],
                                                    "fraction_of_best_floor": rate / best}
        for isa in isas:
            e = timings[isa]
            report["paths"][ISA_NAMES[isa]][name] = e
            cells = [f"{e['rows'][str(r)]['ms']:.3f} ({e['rows'][str(r)]['fraction_of_own_floor']:.0%} / "
                     f"{e['rows'][str(r)]['fraction_of_best_floor']:.0%})" for r in rows]
            print(f"{name} | {ISA_NAMES[isa]} | {e['streamed_one_row_ms']:.3f}, {e['streamed_gb_s']:.1f} | "
                  + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
