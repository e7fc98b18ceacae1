"""One oracle pass by row count, ours beside llama.cpp's, in one run: the kernels' own comparison.

    python scripts/llamacpp/pass_costs.py --oracle default --rows 1,4,8,16 [--quant mixed] [--out FILE.json]

Ours: the model as `--quant` loads it, one pass of R rows (a causal block after a 64-token context), the
fastest of `--repeats`, with the kernels the engine picked.  llama.cpp: `llama-bench -p R -n 0` on the same
GGUF and thread count (a batch of R tokens), its mean.  The two alternate round by round (ours, llama.cpp,
ours, ...) so that a machine whose speed drifts affects both alike; each side keeps its best round.
The llama.cpp build comes from scripts/llamacpp/build.sh.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch


def our_pass_ms(model, rows: int, repeats: int) -> float:  # noqa: ANN001
    from stagedspec.models.pass_spec import PassSpec

    cache = model.new_cache(64 + rows + 1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, 64), generator=g), torch.arange(64), cache)
        cache.commit()
        toks = torch.randint(0, 1000, (1, rows), generator=g)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(toks, torch.arange(64, 64 + rows), cache, PassSpec(logits_rows=slice(0, rows)))
            best = min(best, time.perf_counter() - t0)
            cache.commit([])
    return best * 1e3


def llama_pass_ms(bin_dir, gguf, rows: int, threads: int) -> float:  # noqa: ANN001
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(rows),
                          "-n", "0", "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    record = json.loads(out.stdout)[0]
    return record["avg_ns"] / 1e6


def main() -> int:
    from stagedspec.bench.llamacpp import bin_dir
    from stagedspec.bench.methods import gguf_for
    from stagedspec.hardware import KERNEL_FLAGS, cpu_flags, cpu_name
    from stagedspec.models.loading import load_model
    from stagedspec.models.quant import describe_weights
    from stagedspec.pipeline import resolve_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--oracle", default="default")
    p.add_argument("--quant", default="mixed")
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder, gguf = bin_dir(), gguf_for(args.oracle)
    if folder is None or gguf is None:
        print("needs llama.cpp (scripts/llamacpp/build.sh) and a GGUF oracle", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    dtype = resolve_dtype("auto", "cpu", args.quant)[0]
    model, _ = load_model(args.oracle, dtype=dtype, quant=args.quant)
    rows = [int(r) for r in args.rows.split(",")]
    ours = {r: float("inf") for r in rows}
    theirs = {r: float("inf") for r in rows}
    for _ in range(args.rounds):
        for r in rows:
            ours[r] = min(ours[r], our_pass_ms(model, r, args.repeats))
            theirs[r] = min(theirs[r], llama_pass_ms(folder, gguf, r, threads))
    flags = " ".join(f for f in KERNEL_FLAGS if f in cpu_flags())
    print(f"{cpu_name()} ({flags}), {threads} threads, {time.strftime('%Y-%m-%d')}; oracle {gguf.name}")
    print(f"ours: {describe_weights(model)}, {dtype}; llama.cpp: llama-bench -p R -n 0")
    print("| rows | ours ms | llama.cpp ms | llama.cpp / ours | ours vs our 1 row |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r} | {ours[r]:.1f} | {theirs[r]:.1f} | {theirs[r] / ours[r]:.2f}x | {ours[r] / ours[rows[0]]:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_name(), "flags": flags, "threads": threads, "date": time.strftime("%Y-%m-%d"),
                       "platform": platform.platform(), "oracle": str(gguf), "ours": describe_weights(model),
                       "dtype": str(dtype), "ours_ms": ours, "llama_cpp_ms": theirs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
