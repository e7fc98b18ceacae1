"""In-process A/B: `auto` pricing tree children from the draft's scored root ranks (new) against the fixed
SECOND_CHOICE model (old, RankStats.counts patched to None while it runs), with `ar` and a fixed fan of 3."""
import collections, os, sys
from stagedspec.auto import acceptance
from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams
T = float(os.environ.get("T", "0"))
S = SamplingParams(temperature=T, top_k=50) if T > 0 else SamplingParams()
counts = acceptance.RankStats.counts
models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
cfg = {"ar": SpeculationConfig(method="ar"), "fan3": SpeculationConfig(method="tree", tree_budget=3, tree_depth=1, tree_branching=3),
       "auto_old": SpeculationConfig(method="auto", sizing="measured"), "auto_new": SpeculationConfig(method="auto", sizing="measured")}
pipes = {k: Pipeline.over(models, c) for k, c in cfg.items()}
def mode(k):
    acceptance.RankStats.counts = (lambda self: None) if k == "auto_old" else counts
for k, p in pipes.items():
    mode(k); p.generate(PROSE[5], max_new_tokens=8, chat=True, sampling=S)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
kinds = {"prose": PROSE[:4], "chat": CHAT[:4]}
tot = collections.defaultdict(lambda: [0.0, 0, 0]); ch = collections.defaultdict(collections.Counter)
for _ in range(rounds):
    for kind, ps in kinds.items():
        for p in ps:
            for k, pipe in pipes.items():
                mode(k)
                st = pipe.generate(p, max_new_tokens=64, chat=True, sampling=S).stats
                t = tot[(kind, k)]; t[0] += st.seconds - st.prefill_seconds; t[1] += st.new_tokens; t[2] += st.oracle_forward_passes
                if st.auto_choices: ch[k].update(st.auto_choices)
for kind in kinds:
    base = tot[(kind, "ar")][1] / tot[(kind, "ar")][0]
    for k in pipes:
        s, n, steps = tot[(kind, k)]
        print(f"T={T} {kind:6s} {k:9s} {n/s:6.2f} tok/s {n/s/base:5.3f}x {n/steps:.3f} tok/step {1000*s/steps:.1f} ms/step")
for k, c in ch.items(): print(k, dict(c.most_common(8)))
r = pipes["auto_new"].auto_policy().stats_for(S).ranks
print("ranks misses", r.misses, "hits", r.hits)
