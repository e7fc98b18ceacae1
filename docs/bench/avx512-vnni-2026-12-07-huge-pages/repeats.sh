#!/bin/bash
# The default command against our `ar` on the Qwen oracle with two passes over the prompts (`--repeats 2`: each
# run a request of its own, the order rotated), greedy and T=1 (top-k 50, unseeded), prose and chat; run after
# bench.sh, so `auto` starts from what that run taught it.  Run from this folder.
for kind in prose chat; do
  stagedspec bench --oracle qwen2.5-coder-1.5b --methods ar@mixed,auto@mixed --prompts $kind --n-prompts 4 \
    --max-new-tokens 64 --temperatures 0,1 --top-k 50 --unseeded --repeats 2 --no-plots --out r2-$kind > r2-$kind.log 2>&1
done
