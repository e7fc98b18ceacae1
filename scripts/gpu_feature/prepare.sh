#!/usr/bin/env bash
# Here, before the Qwen feature draft's GPU training (scripts/gpu_feature/README.md): the gguf wheel the device
# machine lacks, the oracle's GGUF and the training's starting point (the kept CPU draft and the committed reply
# caches) cut into parts that fit one call each, and what the device does not need set aside.
#   prepare.sh          do all of it and print how many part calls there are
#   prepare.sh restore  put everything set aside back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
ASIDE=${ASIDE:-/tmp/stagedspec-aside}
PART_BYTES=${PART_BYTES:-58000000}
START=data/distill/qwen2.5-coder-1.5b-feature-draft-wip
# Not needed on the device: the bundled drafts, the recorded benches, the distillation data (what the run needs
# of it travels in the parts).
SET_ASIDE=(src/stagedspec/assets/draft-smollm2-135m src/stagedspec/assets/draft-gemma3-270m docs/bench data)

if [ "${1:-}" = restore ]; then
  for p in "${SET_ASIDE[@]}"; do
    if [ -e "$ASIDE/$p" ]; then mkdir -p "$(dirname "$p")" && rm -rf "$p" && mv "$ASIDE/$p" "$p"; fi
  done
  git status --short | head
  exit 0
fi

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.fparts/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf==0.19.0

ORACLE=$(python3 -c "from stagedspec.models.named import parts_model_path as p; print(p('qwen2.5-coder-1.5b'))")
[ -f "$START/draft.safetensors" ] || { echo "no starting draft in $START" >&2; exit 1; }
# One stream: the GGUF, then a tar of the starting draft and the reply caches (as start/ and replies/).
rm -rf .fparts && mkdir -p .fparts/stage/start .fparts/stage/replies
cp "$START"/draft_config.json "$START"/draft.safetensors .fparts/stage/start/
cp data/distill/qwen2.5-coder-1.5b-replies-*.jsonl.gz .fparts/stage/replies/
{ cat "$ORACLE"; tar cf - -C .fparts/stage start replies; } | split -b "$PART_BYTES" -d -a 2 - .fparts/part
rm -rf .fparts/stage
n=0
for f in .fparts/part*; do mkdir -p ".fparts/p$n" && mv "$f" ".fparts/p$n/"; n=$((n + 1)); done
last=".fparts/p$((n - 1))"
{ stat -c %s "$ORACLE"; sha256sum "$ORACLE" | cut -d' ' -f1; } > "$last/SIZES"

for p in "${SET_ASIDE[@]}"; do
  if [ -e "$p" ]; then mkdir -p "$ASIDE/$(dirname "$p")" && rm -rf "${ASIDE:?}/$p" && mv "$p" "$ASIDE/$p"; fi
done
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
wheels=$(du -cb .whl/* | tail -1 | cut -f1)
biggest=$(du -cb .fparts/p0/* | tail -1 | cut -f1)
echo "$n part calls (p0 .. p$((n - 1))); one carries about $(( (tree + wheels + biggest) / 1048576 )) MiB of 64"
echo "set aside in $ASIDE: ${SET_ASIDE[*]} (prepare.sh restore puts them back)"
