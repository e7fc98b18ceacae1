"""One-row pass of the Qwen2.5-Coder-0.5B draft (300 cached tokens), its whole Q8_0 head against the bundled 24,576-token subset as int8, alternated three times, median of 40 passes each.  `python pass_ms.py`"""
import time, torch
from safetensors import safe_open
from stagedspec.hardware import auto_dtype
from stagedspec.models.loading import load_model
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.quant import resolve_quant, Int8Linear
import stagedspec, pathlib
dtype = torch.bfloat16
m, _ = load_model("qwen2.5-coder-0.5b", dtype=dtype, device="cpu", quant=resolve_quant("auto", "qwen2.5-coder-0.5b", "cpu"))
print(type(m.head_q).__name__, getattr(m.head_q,'format_names',None))
asset = pathlib.Path(stagedspec.__file__).parent / "assets/draft-qwen2.5-coder-1.5b/draft.safetensors"
with safe_open(asset, "pt") as f:
    print([k for k in f.keys() if 'head' in k])
    ids = f.get_tensor("head_tokens")
full = m.head_q
t0=time.time(); w = full.dequantized()[ids].float() if hasattr(full,'dequantized') else None; print('deq', time.time()-t0)
small = Int8Linear(w, None, full.kernels)
def one(n=40):
    cache = m.new_cache(600)
    ids0 = torch.randint(0, 1000, (1, 300))
    with torch.inference_mode():
        m(ids0, torch.arange(300), cache, PassSpec(logits_rows=slice(-1,None))); cache.commit()
        ts=[]
        for i in range(n):
            s=time.perf_counter(); m(torch.tensor([[5]]), torch.tensor([300]), cache, PassSpec()); ts.append(time.perf_counter()-s)
            cache.truncate(300)
    ts.sort(); return ts[len(ts)//2]*1e3
for r in range(3):
    for name, h in (("full", full), ("24k", small)):
        m.head_q = h
        print(r, name, round(one(),2), 'ms')
