"""An ar@int4 decode pass: wall time (no profiler) minus its matmul and attention kernels' in-pass time (profiled).

Usage: python int4_pass_overhead.py [THREADS].  AMX Xeon, 2026-11-23; docs/gpu.md ("The CPU int4 pass").
"""
import time, torch, statistics, sys
from torch.profiler import profile, ProfilerActivity
from stagedspec.models.loading import load_model
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv)>1 else 2)
m, tok = load_model("default", dtype=torch.bfloat16, device="cpu", quant="int4")
cache = m.new_cache(512)
ids = torch.tensor([tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3)])
N = 100
if True:
    m(ids, torch.arange(ids.shape[1]), cache)
    pos = ids.shape[1]; x = torch.tensor([[5]]); p = torch.tensor([pos])
    for _ in range(20): m(x, p, cache)
    ts=[]
    for _ in range(300):
        t=time.perf_counter(); m(x, p, cache); ts.append(time.perf_counter()-t)
    wall = statistics.median(ts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(N): m(x, p, cache)
ev = prof.key_averages()
kern = sum(e.self_cpu_time_total for e in ev if any(k in e.key for k in ("int4pack", "int8pack", "attention")))
kern = kern / N / 1e6
print(f"pass {wall*1e3:.2f} ms (median of 300) = matmul+attention kernels {kern*1e3:.2f} + rest {(wall-kern)*1e3:.2f} ms "
      f"(context {pos}, {torch.get_num_threads()} threads)")
