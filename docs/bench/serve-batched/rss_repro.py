"""A fast reproduction of the batched server's memory growth (docs/serving.md, the soak): resident memory
of a loop of ragged passes, or of bare bf16 matmuls, over many distinct row counts.

    PYTHONPATH=src OMP_NUM_THREADS=1 python docs/bench/serve-batched/rss_repro.py ragged --shapes vary [--pad]
    OMP_NUM_THREADS=1 python docs/bench/serve-batched/rss_repro.py linear --shapes vary|fixed|bucket

`ragged`: `forward_ragged` over the default oracle (bf16), 1-8 segments of 1-24 rows each against caches of
20-480 entries (`--shapes vary`), or fixed 8 x 4 rows at 200 entries (`fixed`), or rows varied at a fixed
cache length (`rows`), or cache lengths varied at fixed rows (`keys`); `--pad` pads the rows as the server does.
`linear`: F.linear over the oracle's weight shapes (576 -> 1728, 576, 3072; 1536 -> 576) with M in 1..1536
(`vary`), M = 64 (`fixed`) or M padded to 25 sizes (`bucket`).  Prints resident memory (/proc/self/statm)
every `--every` iterations.  Bisect with ONEDNN_PRIMITIVE_CACHE_CAPACITY=N,
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2, `--no-mkldnn`, `--trim N` (malloc_trim every N).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import time

import torch
import torch.nn.functional as F


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["ragged", "linear"])
    ap.add_argument("--shapes", default="vary", choices=["vary", "fixed", "rows", "keys", "bucket"])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--pad", action="store_true")
    ap.add_argument("--trim", type=int, default=0)
    ap.add_argument("--no-mkldnn", action="store_true")
    a = ap.parse_args()
    if a.no_mkldnn:
        torch.backends.mkldnn.enabled = False
    libc = ctypes.CDLL("libc.so.6")
    rng = random.Random(0)
    step = _ragged(a, rng) if a.what == "ragged" else _linear(a, rng)
    t0 = time.time()
    print(f"it 0 rss {rss_mb():.0f} MB", flush=True)
    for it in range(1, a.iters + 1):
        with torch.inference_mode():
            step()
        if a.trim and it % a.trim == 0:
            libc.malloc_trim(0)
        if it % a.every == 0:
            print(f"it {it} rss {rss_mb():.0f} MB ({time.time() - t0:.0f} s)", flush=True)


def _ragged(a: argparse.Namespace, rng: random.Random):  # noqa: ANN202
    from stagedspec.cache import KVCache
    from stagedspec.models.ragged import Segment, forward_ragged
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    model = Pipeline.load("default", [], speculation=SpeculationConfig(method="ar"), dtype="bf16", quant="none").model
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.n_heads
    caches = [KVCache(cfg.n_layers, cfg.n_kv_heads, head_dim, 512, dtype=model.embed.weight.dtype) for _ in range(8)]

    def step() -> None:
        n = 8 if a.shapes in ("fixed", "keys") else rng.randint(1, 8)
        segs = []
        for c in caches[:n]:
            T = 4 if a.shapes in ("fixed", "keys") else rng.randint(1, 24)
            L = 200 if a.shapes in ("fixed", "rows") else rng.randint(20, 480)
            c.length, c.pending = L, 0
            segs.append(Segment(torch.randint(0, cfg.vocab_size, (1, T)), torch.arange(L, L + T), c))
        forward_ragged(model, segs, pad=a.pad)
    return step


def _linear(a: argparse.Namespace, rng: random.Random):  # noqa: ANN202
    torch.manual_seed(0)
    ws = [torch.randn(o, i, dtype=torch.bfloat16) for o, i in [(1728, 576), (576, 576), (3072, 576), (576, 1536)]]
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280,
             1536]

    def step() -> None:
        M = 64 if a.shapes == "fixed" else rng.randint(1, 1536)
        if a.shapes == "bucket":
            M = next(s for s in sizes if s >= M)
        for w in ws:
            F.linear(torch.randn(1, M, w.shape[1], dtype=torch.bfloat16), w)
    return step


if __name__ == "__main__":
    main()
