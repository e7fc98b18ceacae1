"""Cost of one quantised linear layer by rows on this machine: streamed from memory and held in cache.

    python scripts/kernels/rows.py [--threads 2] [--format int4]

Streamed: 48 copies of a 1536 x 1536 matrix (about 70 MB in int4), so every call reads its weights from
memory, as a decoding pass does; in cache: the same matrix 48 times.  Each row count is timed as the best
of 7 sweeps, and the AVX2 / VNNI results are checked bit for bit against the portable path.  The figures
in docs/kernels.md came from this script.
"""

from __future__ import annotations

import argparse
import time

import torch

from stagedspec.kernels.native import ISA_NAMES, native_kernels
from stagedspec.kernels.packing import FORMATS, random_format

ROWS = (1, 2, 3, 4, 8, 16, 32)


def sweep_seconds(kernels, x: torch.Tensor, mats: list[torch.Tensor], fmt: int, n: int, reps: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for m in mats:
            kernels.qlinear(x, m, [fmt], [n])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are unavailable on this machine")
    n = k = 1536
    weight, _ = random_format(args.format, n, k, torch.Generator().manual_seed(0))
    fmt = FORMATS[args.format]
    print(f"{args.format} {n}x{k}, {ISA_NAMES[kernels.isa]}, {args.threads} threads")
    for label, mats in (("streamed", [weight.clone() for _ in range(48)]), ("in cache", [weight] * 48)):
        costs = {}
        for rows in ROWS:
            x = torch.randn(rows, k)
            sweep_seconds(kernels, x, mats, fmt, n, 2)
            costs[rows] = sweep_seconds(kernels, x, mats, fmt, n, 7) / len(mats)
        rate = weight.numel() / costs[1] / 1e9
        print(f"{label:9s} one row {rate:5.1f} GB/s | " + "  ".join(
            f"{r}: {costs[r] * 1e3:.3f} ms ({costs[r] / costs[1]:.2f}x)" for r in ROWS))
    portable = kernels.with_isa(0)
    for rows in (1, 3, 4, 5, 8, 9, 16):
        x = torch.randn(rows, k) * 3
        if not torch.equal(kernels.qlinear(x, weight, [fmt], [n]), portable.qlinear(x, weight, [fmt], [n])):
            raise SystemExit(f"{rows} rows: the {ISA_NAMES[kernels.isa]} result differs from the portable path")
    print("bit-identical to the portable path for 1, 3, 4, 5, 8, 9 and 16 rows")


if __name__ == "__main__":
    main()
