#!/bin/bash
# The sixth run's draft against the kept one and the 0.5B, greedy, three kinds, 8 prompts x 64 tokens, nothing else running.
# from the repo root; DRAFT: the sixth run's draft, now src/stagedspec/assets/draft-qwen2.5-coder-1.5b
W=data/distill/qwen2.5-coder-1.5b-feature-draft-wip
N=DRAFT
for kind in prose chat humaneval; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --methods llamacpp,llamacpp-spec,llamacpp-ngram,ar@mixed,auto@mixed,chain@mixed/$W,chain@mixed/$N,auto@mixed/$N \
    --prompts $kind --n-prompts 8 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
