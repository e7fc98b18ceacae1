#!/bin/bash
# Qwen2.5-Coder-1.5B with the 0.5B draft, its head cut to the bundled 24,576-token subset (--draft-vocab auto,
# the default) against its whole head (SPEC@full), side by side in one run per prompt kind; greedy, 4 prompts x
# 64 tokens, llama.cpp's plain decoding (its AMX build, scripts/llamacpp/build.sh) in the same run.
# KINDS=humaneval bash bench.sh: the same on HumanEval (run after the other two).
FEATURE=$(python3 -c "import stagedspec, pathlib; print(pathlib.Path(stagedspec.__file__).parent / 'assets' / 'draft-qwen2.5-coder-1.5b')")
for kind in ${KINDS:-prose chat}; do
  stagedspec bench --oracle qwen2.5-coder-1.5b \
    --methods "llamacpp,ar@mixed,auto@mixed,auto@mixed/qwen2.5-coder-0.5b,auto@mixed/qwen2.5-coder-0.5b@full,staged@mixed/$FEATURE+qwen2.5-coder-0.5b,staged@mixed/$FEATURE+qwen2.5-coder-0.5b@full" \
    --prompts $kind --n-prompts 4 --max-new-tokens 64 --temperatures 0 --no-plots --out qwen-$kind > qwen-$kind.log 2>&1
done
