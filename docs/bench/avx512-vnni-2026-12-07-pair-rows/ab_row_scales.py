"""`auto` with a verification scale per arm kind and row count (new) against one per arm kind (old), and `ar`,
interleaved in one process on 4 prose and 4 chat prompts x 64 tokens (Qwen2.5-Coder-1.5B, the default draft).

    python docs/bench/avx512-vnni-2026-12-07-pair-rows/ab_row_scales.py 0 2 > ab_row_scales.txt
"""
import sys, time
from stagedspec.auto.step_costs import StepCosts
from stagedspec.bench.prompts import load_prompts
from stagedspec.heap import freeze_loaded
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
new = Pipeline.load("qwen2.5-coder-1.5b", None, quant="auto", speculation=SpeculationConfig.tuned("auto", "auto"))
# a second auto pipeline, loaded the same way; its costs priced with one verification scale per arm kind
old = Pipeline.load("qwen2.5-coder-1.5b", None, quant="auto", speculation=SpeculationConfig.tuned("auto", "auto"))
ar = Pipeline(new.model, new.tokenizer, [], SpeculationConfig.tuned("ar", "auto"), learned=new.learned, device=new.device, dtype=new.dtype)
oc = old.auto_policy().costs
oc.verify_scale_for = lambda kind, sampled, rows=None: StepCosts.verify_scale_for(oc, kind, sampled)
prompts = load_prompts("prose", 4) + load_prompts("chat", 4)
sampling = SamplingParams(temperature=temp, top_k=50) if temp > 0 else SamplingParams()
for p in (ar, new, old):
    p.generate(prompts[0], chat=True, max_new_tokens=8, sampling=sampling)
freeze_loaded()
tot = {k: [0.0, 0, 0.0] for k in ("ar", "new", "old")}
for r in range(rounds):
    for i, pr in enumerate(prompts):
        order = [("ar", ar), ("new", new), ("old", old)]
        if (i + r) % 2: order = [order[0], order[2], order[1]]
        line = []
        for name, p in order:
            t = time.perf_counter()
            out = p.generate(pr, chat=True, max_new_tokens=64, sampling=sampling)
            s = time.perf_counter() - t
            acc = out.stats.new_tokens / max(1, out.stats.oracle_forward_passes)
            tot[name][0] += s; tot[name][1] += out.stats.new_tokens; tot[name][2] += acc
            line.append(f"{name} {out.stats.new_tokens/s:.1f}")
        print(r, i, " ".join(line), flush=True)
n = rounds * len(prompts)
print({k: f"{v[1]/v[0]:.2f} tok/s, tok/pass {v[2]/n:.2f}" for k, v in tot.items()})
print(f"new/ar {tot['new'][1]/tot['new'][0] / (tot['ar'][1]/tot['ar'][0]):.3f}  old/ar {tot['old'][1]/tot['old'][0] / (tot['ar'][1]/tot['ar'][0]):.3f}")
