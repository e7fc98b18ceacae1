#!/bin/bash
# The Qwen2.5-Coder-1.5B oracle and SmolLM2-135M against llama.cpp's native build (scripts/llamacpp/build.sh) on a
# Zen 4 EPYC, after the packed weights moved to 2 MB pages and the prefetch distance became timed per machine:
# greedy, 4 prompts x 64 tokens per kind, our `ar` and the default (`auto`), llama.cpp plain and `ngram-mod`.
# Run from this folder.
for kind in prose chat humaneval; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods "llamacpp,llamacpp-ngram,ar@mixed,auto@mixed" \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
for kind in prose chat; do
  stagedspec bench --methods llamacpp,ar@mixed,auto@mixed --prompts $kind --n-prompts 4 --max-new-tokens 64 \
    --temperatures 0 --no-plots --out smollm2-$kind > smollm2-$kind.log 2>&1
done
