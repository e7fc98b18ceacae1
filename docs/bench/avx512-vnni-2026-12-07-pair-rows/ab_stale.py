"""`auto` whose scales count less the longer they have not learned (new) against scales that keep their weight
(old), and `ar`, interleaved in one process on 4 prose and 4 chat prompts x 64 tokens (Qwen2.5-Coder-1.5B, the
default draft); sampled requests unseeded, so both `auto` policies learn times.

    python docs/bench/avx512-vnni-2026-12-07-pair-rows/ab_stale.py TEMPERATURE ROUNDS > ab_stale_tT.txt
"""
import sys
import time

from stagedspec.bench.prompts import load_prompts
from stagedspec.heap import freeze_loaded
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
new = Pipeline.load("qwen2.5-coder-1.5b", None, quant="auto", speculation=SpeculationConfig.tuned("auto", "auto"))
old = Pipeline.load("qwen2.5-coder-1.5b", None, quant="auto", speculation=SpeculationConfig.tuned("auto", "auto"))
ar = Pipeline(new.model, new.tokenizer, [], SpeculationConfig.tuned("ar", "auto"), learned=new.learned,
              device=new.device, dtype=new.dtype)
oc = old.auto_policy().costs
oc._kept = lambda key, weight: 1.0 - weight  # no staleness
prompts = load_prompts("prose", 4) + load_prompts("chat", 4)
sampling = SamplingParams(temperature=temp, top_k=50) if temp > 0 else SamplingParams()
for p in (ar, new, old):
    p.generate(prompts[0], chat=True, max_new_tokens=8, sampling=sampling)
freeze_loaded()
tot = {k: [0.0, 0, 0.0] for k in ("ar", "new", "old")}
for r in range(rounds):
    for i, pr in enumerate(prompts):
        order = [("ar", ar), ("new", new), ("old", old)]
        if (i + r) % 2:
            order = [order[0], order[2], order[1]]
        line = []
        for name, p in order:
            t = time.perf_counter()
            out = p.generate(pr, chat=True, max_new_tokens=64, sampling=sampling)
            s = time.perf_counter() - t
            tot[name][0] += s
            tot[name][1] += out.stats.new_tokens
            tot[name][2] += out.stats.new_tokens / max(1, out.stats.oracle_forward_passes)
            line.append(f"{name} {out.stats.new_tokens / s:.1f}")
        print(r, i, " ".join(line), flush=True)
n = rounds * len(prompts)
print({k: f"{v[1] / v[0]:.2f} tok/s, tok/pass {v[2] / n:.2f}" for k, v in tot.items()})
rate = {k: v[1] / v[0] for k, v in tot.items()}
print(f"new/ar {rate['new'] / rate['ar']:.3f}  old/ar {rate['old'] / rate['ar']:.3f}  new/old {rate['new'] / rate['old']:.3f}")
