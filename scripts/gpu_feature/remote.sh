#!/usr/bin/env bash
# The commands of each device call of the Qwen feature draft's GPU training (scripts/gpu_feature/README.md), run
# there from the repo root:
#   remote.sh part N   keep carried part N in /tmp/m; N = 0 also installs the carried gguf wheel
#   remote.sh start    join and check the GGUF, unpack the starting draft and reply caches, start the distillation
#                      in its own session, wait for it (at most WAIT_S seconds), then hand back what exists
#   remote.sh wait     wait for the distillation again (at most WAIT_S seconds), then hand back what exists
# What comes back in $OUT: status, the log, metrics.json, and the draft (a tar cut into 15 MB pieces; a run cut
# off by its time box is written from its last checkpoint by scripts/distill/checkpoint_draft.py).
# DRYRUN=1 start prints the distillation's command instead (tests/test_gpu_feature.py parses it with the CLI).
# A call must end inside the device's 10 minutes, and the next one must follow within its 30 s of warmth.
set -uo pipefail
cd "$(dirname "$0")/../.."
M=/tmp/m
R=/tmp/fd
SITE=/tmp/site
WAIT_S=${WAIT_S:-540}
export PYTHONPATH=$SITE:src PYTHONUNBUFFERED=1 STAGEDSPEC_CACHE=/tmp/cache
source scripts/device/common.sh

# The third CPU run's recipe at GPU scale: 32 x 512 tokens a step, several thousand new oracle replies (prose and
# chat requests, and chat requests about the stdlib's documented functions), repeated twice, from the kept draft.
DISTILL=(distill --device "${DEVICE:-cuda}" --oracle "$M/oracle.gguf" --kind feature --out "$R/draft" --work-dir "$R/work"
  --init-from "$M/start" --layers 1 --mlp-width 3072 --head-from-oracle --vocab-top 24576
  --ttt-steps 3 --ttt-decay 0.8 --feature-loss 0.1 --tokens "${TOKENS:-3000000}" --seq-len "${SEQ:-512}" --batch-size "${BATCH:-32}"
  --lr "${LR:-3e-4}" --min-lr-ratio 0.05 --chat-wrap 0.5 --oracle-samples "${CODE_SAMPLES:-2400}"
  --chat-samples "${CHAT_SAMPLES:-1200}" --sample-tokens 192 --sample-repeat 2 --sample-batch 256
  --samples-cache "$R/work/oracle_samples.jsonl" --eval-every 25 --checkpoint-every 25 --save-dtype int8
  --seed "${SEED:-9}" --max-minutes "${TRAIN_MINUTES:-5}")

finish() {  # the run's state; what exists of the draft goes to $OUT
  echo "--- distill"; tr '\r' '\n' < "$R/distill.log" 2>/dev/null | grep -v "^$" | grep -v "it/s\]$" | tail -12
  [ -f "$R/done" ] || { echo "still running"; return; }
  if [ ! -f "$R/draft/draft.safetensors" ] && [ -f "$R/work/checkpoint.pt" ]; then  # cut off by its time box
    python3 scripts/distill/checkpoint_draft.py --oracle "$M/oracle.gguf" --checkpoint "$R/work/checkpoint.pt" \
      --out "$R/draft" --save-dtype int8 >> "$R/distill.log" 2>&1
  fi
  cp "$R/distill.log" "$R/status" "${OUT:?}/" 2>/dev/null
  cp "$R/work/metrics.json" "$OUT/" 2>/dev/null
  if [ -f "$R/draft/draft.safetensors" ]; then
    tar cf "$R/draft.tar" -C "$R" draft && split -b 15000000 -d "$R/draft.tar" "$OUT/draft.tar."
  fi
  ls -la "$OUT"
}

wait_run() {
  end=$((SECONDS + WAIT_S))
  while [ ! -f "$R/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  finish
}

case "${1:-}" in
  part)
    keep_part .fparts "${2:?part number}" "$M" "gguf-*.whl" || exit 1
    echo "$(ls "$M" | grep -c '^part') parts in $M, $(du -sm "$M" | cut -f1) MB"
    ;;
  start)
    if [ "${DRYRUN:-0}" = 1 ]; then echo "stagedspec ${DISTILL[*]}"; exit 0; fi
    { read -r size; read -r sum; } < "$M/SIZES" || { echo "SIZES missing: the last part has not arrived"; exit 1; }
    cat "$M"/part* | head -c "$size" > "$M/oracle.gguf"
    echo "$sum  $M/oracle.gguf" | sha256sum -c || exit 1
    cat "$M"/part* | tail -c +$((size + 1)) | tar xf - -C "$M" || exit 1
    rm -f "$M"/part*
    rm -rf "$R" && mkdir -p "$R/work"
    zcat "$M"/replies/*.jsonl.gz > "$R/work/oracle_samples.jsonl"  # replies made earlier are not sampled again
    setsid nohup bash -c "python3 -m stagedspec ${DISTILL[*]} > $R/distill.log 2>&1; \
      echo \"distill exit \$?\" >> $R/status; touch $R/done" > /dev/null 2>&1 &
    wait_run
    ;;
  wait)
    wait_run
    ;;
  *)
    echo "usage: remote.sh part N | start | wait" >&2; exit 2
    ;;
esac
