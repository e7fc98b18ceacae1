#!/bin/bash
# The default command (auto with the bundled feature draft, now with fan arms) against ar and llama.cpp, greedy,
# three kinds, 8 prompts x 64 tokens; then T=1 (top-k 50) on prose and chat, 4 prompts x 64 tokens.
for kind in prose chat humaneval; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods llamacpp,llamacpp-ngram,ar@mixed,auto@mixed \
    --prompts $kind --n-prompts 8 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
for kind in prose chat; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods ar@mixed,auto@mixed \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 1 --top-k 50 --no-plots --out t1-$kind > t1-$kind.log 2>&1
done
# then (commit 87ec470) the same T=1 runs unseeded, as `generate` runs them by default
for kind in prose chat; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods ar@mixed,auto@mixed \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 1 --top-k 50 --unseeded --no-plots --out t1u-$kind > t1u-$kind.log 2>&1
done
