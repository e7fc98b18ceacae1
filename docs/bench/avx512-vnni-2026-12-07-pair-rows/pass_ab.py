"""Whole passes of an oracle (`--quant auto`, 256 cached tokens) of 1-4 rows with the 512-bit tiles paired from 2
rows (this machine's measured setting) and from 4 (the earlier fixed one), interleaved in one process.

    python docs/bench/avx512-vnni-2026-12-07-pair-rows/pass_ab.py > pass_ab.txt               # Qwen2.5-Coder-1.5B
    python docs/bench/avx512-vnni-2026-12-07-pair-rows/pass_ab.py default > pass_ab_smollm2.txt  # SmolLM2-135M
"""
import statistics
import sys

import torch

from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.profiling import forward_cost_curve

oracle = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
pipe = Pipeline.load(oracle, None, quant="auto", speculation=SpeculationConfig.tuned("ar", "auto"))
pair_from = torch.ops.stagedspec_qlinear.pair_min_rows
print("measured setting: pairs from", pair_from(0), "rows")
res: dict[tuple[int, int], list[float]] = {}
for sweep in range(6):
    for rows in (1, 2, 3, 4):
        for m in (2, 4):
            pair_from(m)
            res.setdefault((rows, m), []).append(forward_cost_curve(pipe.model, sizes=(rows,), repeats=5)[rows])
for rows in (1, 2, 3, 4):
    a, b = min(res[(rows, 4)]), min(res[(rows, 2)])
    print(f"{rows} rows: pairs from 4: {1e3 * a:.2f} ms (median {1e3 * statistics.median(res[(rows, 4)]):.2f}), "
          f"from 2: {1e3 * b:.2f} ms (median {1e3 * statistics.median(res[(rows, 2)]):.2f}); {b / a:.3f}x")
