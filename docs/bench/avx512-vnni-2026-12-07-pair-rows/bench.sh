#!/bin/bash
# The Qwen2.5-Coder-1.5B oracle against llama.cpp's native build (scripts/llamacpp/build.sh) on a Zen 4 EPYC, after
# the 512-bit tiles pair from 2 rows and `auto` prices verifications per row count: greedy, 4 prompts x 64 tokens
# per kind, our `ar` and the default (`auto`), llama.cpp plain and `ngram-mod`; then `ar` and `auto` at T=1
# (top-k 50, unseeded) on prose and chat, two passes over the prompts.  Run from this folder.
for kind in prose chat humaneval; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods "llamacpp,llamacpp-ngram,ar@mixed,auto@mixed" \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
for kind in prose chat; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods ar@mixed,auto@mixed --prompts $kind --n-prompts 4 \
    --max-new-tokens 64 --temperatures 1 --top-k 50 --unseeded --repeats 2 --no-plots --out t1-$kind > t1-$kind.log 2>&1
done
# SmolLM2-135M (the default oracle): `ar` and the default, greedy and T=1, two passes over the prompts
for kind in prose chat; do
  stagedspec bench --methods ar@mixed,auto@mixed --prompts $kind --n-prompts 4 --max-new-tokens 64 \
    --temperatures 0,1 --top-k 50 --unseeded --repeats 2 --no-plots --out smollm2-$kind > smollm2-$kind.log 2>&1
done
