#!/bin/bash
# The Qwen2.5-Coder pair on a Zen 4 EPYC (AVX-512 VNNI/BF16, no AMX, no AVX-VNNI) against llama.cpp's native build
# (scripts/llamacpp/build.sh): greedy, three kinds, 4 prompts x 64 tokens; then T=1 (top-k 50, unseeded) on prose
# and chat; then SmolLM2-135M (the default oracle) greedy on the three kinds.  Run from this folder.
FEATURE=$(python3 -c "import stagedspec, pathlib; print(pathlib.Path(stagedspec.__file__).parent / 'assets' / 'draft-qwen2.5-coder-1.5b')")
DRAFT_GGUF=$(python3 -c "from stagedspec.models.named import parts_model_path; print(parts_model_path('qwen2.5-coder-0.5b'))")
for kind in prose chat humaneval; do
  stagedspec bench --oracle qwen2.5-coder-1.5b \
    --methods "llamacpp,llamacpp-spec/$DRAFT_GGUF,llamacpp-ngram,ar@mixed,auto@mixed,auto@mixed/qwen2.5-coder-0.5b,staged@mixed/$FEATURE+qwen2.5-coder-0.5b" \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
for kind in prose chat; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods ar@mixed,auto@mixed \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 1 --top-k 50 --unseeded --no-plots --out t1u-$kind > t1u-$kind.log 2>&1
done
for kind in prose chat humaneval; do
  stagedspec bench --methods llamacpp,ar@mixed,auto@mixed --prompts $kind --n-prompts 4 --max-new-tokens 64 \
    --temperatures 0 --no-plots --out smollm2-$kind > smollm2-$kind.log 2>&1
done
