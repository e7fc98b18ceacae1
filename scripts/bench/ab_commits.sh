#!/bin/bash
# Two commits' speed on this machine, alternating: the check that a change kept behaviour and speed.
#
#   scripts/bench/ab_commits.sh BEFORE AFTER ROUNDS OUT [bench options...]
#
# Each round runs `stagedspec bench` from a worktree of BEFORE, then from one of AFTER (in /tmp), with the
# same options (default: SmolLM2, `ar` and `auto` on 4 prose prompts x 64 tokens, greedy) and a cache of
# its own per commit, so that neither reads what the other learned.  A shared 2-core VM drifts by 10% between
# runs minutes apart, so one pair proves little: compare the medians over the rounds, and the tokens, which
# must be identical (scripts/bench/ab_summary.py reads OUT and prints both).  Nothing else may run meanwhile.
set -euo pipefail
BEFORE=$1; AFTER=$2; ROUNDS=$3; OUT=$4; shift 4
OPTS=("$@")
[ ${#OPTS[@]} -eq 0 ] && OPTS=(--oracle default --methods ar@mixed,auto@mixed --prompts prose --n-prompts 4
                               --max-new-tokens 64 --temperatures 0)
ROOT=$(git rev-parse --show-toplevel)
mkdir -p "$OUT"
for side in before after; do
  commit=$([ $side = before ] && echo "$BEFORE" || echo "$AFTER")
  tree=/tmp/ab-$side
  [ -d $tree ] && git -C "$ROOT" worktree remove --force $tree
  git -C "$ROOT" worktree add --detach -q $tree "$commit"
done
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    (cd /tmp/ab-$side && PYTHONPATH=/tmp/ab-$side/src STAGEDSPEC_CACHE=/tmp/ab-cache-$side \
      python -m stagedspec bench "${OPTS[@]}" --no-plots --no-progress --out "$OUT/$side-$r" > "$OUT/$side-$r.log" 2>&1)
  done
done
for side in before after; do git -C "$ROOT" worktree remove --force /tmp/ab-$side; done
