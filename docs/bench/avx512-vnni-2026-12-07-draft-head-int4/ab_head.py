"""In-process A/B of the Qwen feature draft's head (24,576 rows of the oracle's own head) as int8 against int4.

Why: the head is 60% of the draft's int8 bytes, and a fan of the root's children pays one draft pass a step.
Every configuration runs each prompt in turn in one process (this VM drifts 20-30% between processes):
`ar`, and a fixed fan of 3 (`tree`, budget 3, depth 1) with the draft's head as int8, then as int4 (the draft's
layers and fusing fc stay int8).  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-draft-head-int4/ab_head.py [ROUNDS]
    T=1 python ...   # sampled at T=1, top-k 50, unseeded

Prints tok/s, the ratio to `ar`, tokens a step, ms a step and the draft's ms a step per prompt kind.
"""
import collections
import os
import sys

from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.model_set import ModelSet
from stagedspec.models.quant import Int4Linear, Int8Linear
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams

T = float(os.environ.get("T", "0"))
SAMPLING = SamplingParams(temperature=T, top_k=50) if T > 0 else SamplingParams()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    draft = models.draft_models[0]
    rows = draft.head.weight.detach()
    heads = {"head-int8": Int8Linear(rows, None), "head-int4": Int4Linear(rows, None)}
    ar = Pipeline.over(models, SpeculationConfig(method="ar"))
    fan = Pipeline.over(models, SpeculationConfig(method="tree", tree_budget=3, tree_depth=1, tree_branching=3))
    runs = [("ar", ar, None), *((name, fan, head) for name, head in heads.items())]
    for _, pipe, head in runs:  # warm-up on a prompt the comparison does not use
        if head is not None:
            draft.head_q = head
        pipe.generate(PROSE[5], max_new_tokens=8, chat=True, sampling=SAMPLING)
    kinds = {"prose": PROSE[:4], "chat": CHAT[:4]}
    totals = collections.defaultdict(lambda: [0.0, 0, 0, 0.0])
    for _ in range(rounds):
        for kind, prompts in kinds.items():
            for prompt in prompts:
                for name, pipe, head in runs:
                    if head is not None:
                        draft.head_q = head
                    st = pipe.generate(prompt, max_new_tokens=64, chat=True, sampling=SAMPLING).stats
                    t = totals[(kind, name)]
                    t[0] += st.seconds - st.prefill_seconds
                    t[1] += st.new_tokens
                    t[2] += st.oracle_forward_passes
                    t[3] += st.draft_seconds
    for kind in kinds:
        s, n, _, _ = totals[(kind, "ar")]
        base = n / s
        for name, _, _ in runs:
            s, n, steps, d = totals[(kind, name)]
            print(f"T={T:g} {kind:6s} {name:10s} {n / s:6.2f} tok/s {n / s / base:5.3f}x {n / steps:.3f} tok/step "
                  f"{1000 * s / steps:5.1f} ms/step  draft {1000 * d / steps:.2f} ms/step")


if __name__ == "__main__":
    main()
