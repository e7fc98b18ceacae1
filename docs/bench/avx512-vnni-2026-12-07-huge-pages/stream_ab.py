"""40 copies of one random 4096 x 1536 Q4_K layer (145 MB) read a row at a time: on 4 KB pages against one
mapping advised for 2 MB pages, at 4 and 8 KB ahead, best of 7 sweeps each (the first measurement behind
`kernels.huge_pages` and `kernels.prefetch`).  Usage: python docs/bench/avx512-vnni-2026-12-07-huge-pages/stream_ab.py
"""
import mmap, time, torch
from stagedspec.kernels.native import native_kernels
from stagedspec.kernels.packing import FORMATS, random_format
k = native_kernels()
packed, _ = random_format("q4_k", 4096, 1536, torch.Generator().manual_seed(0))
n = packed.numel(); M = 40
small = [packed.clone() for _ in range(M)]
align = 2 << 20
per = (n + 4095) // 4096 * 4096
size = per * M + align
mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
mm.madvise(mmap.MADV_HUGEPAGE)
arena = torch.frombuffer(mm, dtype=torch.uint8)
off = (-arena.data_ptr()) % align
huge = []
for i in range(M):
    t = arena[off + i * per: off + i * per + n]
    t.copy_(packed)
    huge.append(t)
x = torch.randn(1, 1536)
fmt = FORMATS["q4_k"]
def sweep(ws):
    s = time.perf_counter()
    for w in ws: k.qlinear(x, w, [fmt], [4096])
    return time.perf_counter() - s
print(open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0])
for d in (4096, 8192):
    torch.ops.stagedspec_qlinear.prefetch_ahead(d)
    b = {"4k": 1e9, "huge": 1e9}
    for _ in range(7):
        b["4k"] = min(b["4k"], sweep(small)); b["huge"] = min(b["huge"], sweep(huge))
    print(d, {kk: f"{v*1e3:.2f} ms {n*M/v/1e9:.1f} GB/s" for kk, v in b.items()})
assert all(torch.equal(k.qlinear(x, a, [fmt], [4096]), k.qlinear(x, b, [fmt], [4096])) for a, b in zip(small[:2], huge[:2]))
