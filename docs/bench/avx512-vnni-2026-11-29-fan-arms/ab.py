"""In-process interleaved A/B of fixed tree shapes and `auto` on the Qwen oracle with its bundled feature draft.

The VM's speed drifts 20-30% between processes, so configurations are compared in one process, each prompt run
by every configuration in turn.  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-11-29-fan-arms/ab.py [DRAFT] [ROUNDS] [TOKENS] [CONFIGS]
    T=1 python ...   # sampled at T=1, top-k 50, unseeded (`auto` learns times as the CLI does)

Prints tok/s, the ratio to `ar`, tokens a step, ms a step and draft ms a step per prompt kind, and the arms
`auto` chose.
"""
import collections
import os
import sys

from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams

T = float(os.environ.get("T", "0"))
SAMPLING = SamplingParams(temperature=T, top_k=50) if T > 0 else SamplingParams()
CONFIGS = {
    "ar": SpeculationConfig(method="ar"),
    "auto": SpeculationConfig(method="auto", sizing="measured"),
    "chain1": SpeculationConfig(method="chain", chain_length=1),
    "chain2": SpeculationConfig(method="chain", chain_length=2),
    "tree3d1": SpeculationConfig(method="tree", tree_budget=3, tree_depth=1, tree_branching=3),
    "tree4d2": SpeculationConfig(method="tree", tree_budget=4, tree_depth=2, tree_branching=3),
    "tree6d3": SpeculationConfig(method="tree", tree_budget=6, tree_depth=3, tree_branching=3),
}


def main() -> None:
    draft = sys.argv[1] if len(sys.argv) > 1 else "default"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else list(CONFIGS)
    models = ModelSet.load("qwen2.5-coder-1.5b", draft, method="auto", quant="mixed")
    pipes = {k: Pipeline.over(models, CONFIGS[k]) for k in names}
    kinds = {"prose": PROSE[:4], "chat": CHAT[:4]}
    for p in pipes.values():  # warm-up on a prompt the comparison does not use
        p.generate(PROSE[5], max_new_tokens=8, chat=True)
    totals = {(k, kind): dict(seconds=0.0, tokens=0, steps=0, draft=0.0) for k in pipes for kind in kinds}
    choices: collections.Counter = collections.Counter()
    for _ in range(rounds):
        for kind, prompts in kinds.items():
            for prompt in prompts:
                for k, p in pipes.items():
                    st = p.generate(prompt, max_new_tokens=tokens, chat=True, sampling=SAMPLING).stats
                    t = totals[(k, kind)]
                    t["seconds"] += st.seconds - st.prefill_seconds
                    t["tokens"] += st.new_tokens
                    t["steps"] += st.oracle_forward_passes
                    t["draft"] += st.draft_seconds
                    if k == "auto":
                        choices.update(st.auto_choices)
    for kind in kinds:
        ar = totals.get(("ar", kind))
        base = ar["tokens"] / ar["seconds"] if ar else 1.0
        for k in pipes:
            t = totals[(k, kind)]
            rate = t["tokens"] / t["seconds"]
            print(f"{kind:6s} {k:8s} {rate:6.2f} tok/s {rate / base:5.3f}x  {t['tokens'] / t['steps']:.2f} tok/step  "
                  f"{1000 * t['seconds'] / t['steps']:.1f} ms/step  draft {1000 * t['draft'] / t['steps']:.1f} ms/step")
    print("auto choices", dict(choices.most_common()))


if __name__ == "__main__":
    main()
