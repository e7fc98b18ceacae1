#!/usr/bin/env bash
# The commands of each device call of the Qwen pair's GPU bench (scripts/gpu_pair/README.md), run there from
# the repo root:
#   remote.sh part N   keep carried part N in /tmp/m; N = 0 also installs the carried wheels and starts the
#                      CUDA tests in the background (from a copy of the tree, /tmp/repo)
#   remote.sh start    join and check the two GGUFs, start the bench in its own session, wait for it
#   remote.sh again    the bench once more on the joined GGUFs, e.g. DTYPE=fp32 TEMPS=0 TOKENS=64 remote.sh again
#                      (BIT_EXACT=1: with --bit-exact)
#   remote.sh wait     wait for the bench (at most WAIT_S seconds); when it is done, copy its report to $OUT
#   remote.sh trace    `auto`'s steps against `ar`'s on the same prompts, from no learned state
#                      (scripts/auto/trace_steps.py; TEMP=1: sampled), to $OUT/trace-T$TEMP.txt
# DRYRUN=1 prints the bench's command instead (tests/test_gpu_pair.py parses it with the CLI).
# A call must end inside the device's 10 minutes, and the next one must follow within its 30 s of warmth.
set -uo pipefail
cd "$(dirname "$0")/../.."
M=/tmp/m
B=/tmp/b
SITE=/tmp/site
WAIT_S=${WAIT_S:-480}
BENCH_S=${BENCH_S:-600}
export PYTHONPATH=$SITE:src PYTHONUNBUFFERED=1 STAGEDSPEC_CACHE=/tmp/cache
source scripts/device/common.sh

BENCH=(bench --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" --oracle "$M/oracle.gguf" --draft "$M/draft.gguf"
  --prompts "$M/prompts.jsonl" --n-prompts 100 --max-new-tokens "${TOKENS:-96}"
  --methods "${METHODS:-ar,chain,tree,lookup,staged,auto}" --temperatures "${TEMPS:-0,1}" --top-k 50
  --out "$B/out" --no-plots --no-progress $([ -n "${BIT_EXACT:-}" ] && echo --bit-exact))

bench() {  # start the bench in its own session (it outlives the call if it must), then wait for it
  rm -rf "$B" && mkdir -p "$B"
  setsid nohup bash -c "timeout $BENCH_S python3 -m stagedspec ${BENCH[*]} > $B/bench.log 2>&1; \
    echo \"bench exit \$?\" >> $B/bench.log; touch $B/done" > /dev/null 2>&1 &
  end=$((SECONDS + WAIT_S))
  while [ ! -f "$B/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  finish
}

finish() {  # print the CUDA tests' and the bench's state; when the bench is done, hand its files back
  echo "--- CUDA tests"; tail -5 /tmp/cuda-tests.log 2>/dev/null
  echo "--- bench"; tr '\r' '\n' < "$B/bench.log" 2>/dev/null | grep -v "^$" | tail -25
  if [ -f "$B/done" ]; then
    cp "$B"/out/report.md "$B"/out/results.json "$B"/bench.log /tmp/cuda-tests.log "${OUT:?}/" 2>/dev/null
    ls -la "$OUT"
  fi
}

case "${1:-}" in
  part)
    keep_part .qparts "${2:?part number}" "$M" || exit 1
    if [ "$2" = 0 ]; then
      rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r src tests scripts pyproject.toml /tmp/repo/
      setsid nohup bash -c "cd /tmp/repo && timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cuda.py > /tmp/cuda-tests.log 2>&1; echo \"exit \$?\" >> /tmp/cuda-tests.log" > /dev/null 2>&1 &
    fi
    echo "$(ls "$M" | grep -c '^part') parts in $M, $(du -sm "$M" | cut -f1) MB"
    ;;
  start)
    if [ "${DRYRUN:-0}" = 1 ]; then echo "stagedspec ${BENCH[*]}"; exit 0; fi
    read -r big small < "$M/SIZES" || { echo "SIZES missing: the last part has not arrived"; exit 1; }
    read -r big_sum small_sum < <(sed -n 2p "$M/SIZES")
    cat "$M"/part* | head -c "$big" > "$M/oracle.gguf"
    cat "$M"/part* | tail -c "$small" > "$M/draft.gguf"
    echo "$big_sum  $M/oracle.gguf" | sha256sum -c || exit 1
    echo "$small_sum  $M/draft.gguf" | sha256sum -c || exit 1
    rm -f "$M"/part*
    mkdir -p "$STAGEDSPEC_CACHE/ngram" && cp "$M"/*.npz "$STAGEDSPEC_CACHE/ngram/"
    # The CUDA tests must not share the GPU with the timed bench: give them a minute more, then stop them.
    for _ in $(seq 12); do grep -q "^exit" /tmp/cuda-tests.log 2>/dev/null && break; sleep 5; done
    pkill -f "pytest" 2>/dev/null
    bench
    ;;
  again)
    [ -f "$M/oracle.gguf" ] || { echo "no joined GGUFs in $M: run the part calls and start first"; exit 1; }
    bench
    ;;
  trace)
    [ -f "$M/oracle.gguf" ] || { echo "no joined GGUFs in $M: run the part calls and start first"; exit 1; }
    rm -f "$STAGEDSPEC_CACHE"/costs/*.auto.json
    timeout "${TRACE_S:-200}" python3 scripts/auto/trace_steps.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" \
      --oracle "$M/oracle.gguf" --draft "$M/draft.gguf" --prompts "$M/prompts.jsonl:100" \
      --max-new-tokens "${TOKENS:-96}" --temperature "${TEMP:-0}" > "${OUT:?}/trace-T${TEMP:-0}.txt" 2>&1
    tail -3 "$OUT/trace-T${TEMP:-0}.txt"
    ;;
  wait)
    end=$((SECONDS + WAIT_S))
    while [ ! -f "$B/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    finish
    ;;
  *)
    echo "usage: remote.sh part N | start | again | trace | wait" >&2; exit 2
    ;;
esac
