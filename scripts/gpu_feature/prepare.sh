#!/usr/bin/env bash
# Here, before the Qwen feature draft's GPU training (scripts/gpu_feature/README.md): the gguf wheel the device
# machine lacks, the oracle's GGUF and the training's starting point (the kept CPU draft and the committed reply
# caches) cut into parts that fit one call each, and what the device does not need set aside.
#   prepare.sh          do all of it and print how many part calls there are
#   prepare.sh restore  put everything set aside back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
PART_BYTES=${PART_BYTES:-58000000}
START=src/stagedspec/assets/draft-qwen2.5-coder-1.5b
# Not needed on the device: the bundled drafts, the recorded benches, the distillation data (what the run needs
# of it travels in the parts).
SET_ASIDE=(src/stagedspec/assets/draft-smollm2-135m src/stagedspec/assets/draft-gemma3-270m src/stagedspec/assets/draft-qwen2.5-coder-1.5b
  docs/bench data)

if [ "${1:-}" = restore ]; then
  put_back "${SET_ASIDE[@]}"
  git status --short | head
  exit 0
fi

exclude_here /.whl/ /.fparts/
download_wheels gguf==0.19.0

ORACLE=$(python3 -c "from stagedspec.models.named import parts_model_path as p; print(p('qwen2.5-coder-1.5b'))")
[ -f "$START/draft.safetensors" ] || { echo "no starting draft in $START" >&2; exit 1; }
# One stream: the GGUF, then a tar of the starting draft and the reply caches (as start/ and replies/).
STAGE=$(mktemp -d)
mkdir -p "$STAGE/start" "$STAGE/replies"
cp "$START"/draft_config.json "$START"/draft.safetensors "$STAGE/start/"
cp data/distill/qwen2.5-coder-1.5b-replies-*.jsonl.gz "$STAGE/replies/"
n=$({ cat "$ORACLE"; tar cf - -C "$STAGE" start replies; } | split_into_calls .fparts "$PART_BYTES")
rm -rf "$STAGE"
{ stat -c %s "$ORACLE"; sha256sum "$ORACLE" | cut -d' ' -f1; } > ".fparts/p$((n - 1))/SIZES"

set_aside "${SET_ASIDE[@]}"
echo "$n part calls (p0 .. p$((n - 1))); one carries about $(carried_mib .fparts/p0) MiB of 64"
echo "set aside in $ASIDE: ${SET_ASIDE[*]} (prepare.sh restore puts them back)"
