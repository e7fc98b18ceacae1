"""One Qwen2.5-Coder-1.5B pass by rows: weights on 4 KB or 2 MB pages, the tiles prefetching 4, 8 or 16 KB ahead,
all six interleaved in one process (two copies of the oracle, the first loaded with `move_to_huge_pages` off),
200 tokens cached, the median of 4 timed passes per round.  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-huge-pages/pass_ab.py qwen2.5-coder-1.5b 1,2,4,16 6
"""
import time, statistics, torch, sys, collections
from stagedspec.kernels.native import native_kernels
from stagedspec.models.loading import load_model
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.quant import resolve_quant
from stagedspec.kernels.huge_pages import move_to_huge_pages
import stagedspec.models.loading as L
L.move_to_huge_pages = lambda m: 0
oracle = sys.argv[1]; rows = [int(x) for x in sys.argv[2].split(",")]; rounds = int(sys.argv[3])
native_kernels()
pf = torch.ops.stagedspec_qlinear.prefetch_ahead
models = {}
for name in ("4k", "huge"):
    m, _ = load_model(oracle, dtype=torch.bfloat16, device="cpu", quant=resolve_quant("mixed", oracle, "cpu"))
    if name == "huge": print("moved MB", move_to_huge_pages(m) / 1e6)
    models[name] = m
ids = torch.randint(0, 1000, (1, 264), generator=torch.Generator().manual_seed(0))
caches = {}
with torch.inference_mode():
    for name, m in models.items():
        c = m.new_cache(400); m(ids[:, :200], torch.arange(200), c, PassSpec(logits_rows=slice(-1, None))); c.commit(); caches[name] = c
    res = collections.defaultdict(list)
    for r in range(rounds):
        for n in rows:
            for name in (("4k", "huge") if r % 2 == 0 else ("huge", "4k")):
                for d in ((4096, 8192, 16384) if r % 2 == 0 else (16384, 8192, 4096)):
                    pf(d); m, c = models[name], caches[name]
                    for i in range(5):
                        t = time.perf_counter()
                        m(ids[:, 200:200 + n], torch.arange(200, 200 + n), c, PassSpec(logits_rows=slice(-1, None)))
                        el = time.perf_counter() - t; c.truncate(200)
                        if i: res[(n, name, d)].append(el)
for n in rows:
    base = statistics.median(res[(n, "4k", 4096)])
    print(f"rows {n}: " + "  ".join(f"{name}/{d}: {1e3*statistics.median(res[(n, name, d)]):.2f} ms ({statistics.median(res[(n, name, d)])/base:.3f}x)" for name in ("4k", "huge") for d in (4096, 8192, 16384)))
