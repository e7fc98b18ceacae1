import sys, time, torch
from stagedspec.models.loading import load_model
from stagedspec.models.quant import resolve_quant
from stagedspec.models.pass_spec import PassSpec
torch.set_num_threads(2)
name = sys.argv[1]
model, _ = load_model(name, dtype=torch.bfloat16, device="cpu", quant=resolve_quant("auto", name, "cpu"))
def prefill(tokens=1000):
    cache = model.new_cache(tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    with torch.inference_mode():
        model(ids, torch.arange(tokens), cache, PassSpec(logits_rows=slice(-1, None)))
    return time.perf_counter() - t
prefill(64)
ts = [prefill() for _ in range(3)]
print(f"ours {name} prefill 1000: best {min(ts):.3f} s, runs {' '.join(f'{t:.3f}' for t in ts)}  ({1000/min(ts):.0f} t/s)")
