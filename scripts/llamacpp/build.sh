#!/usr/bin/env bash
# Builds llama.cpp for side-by-side benchmarks, from the tree vendored in the llama-cpp-python sdist
# (PyPI is the only source this workplace reaches). The build is cached: a second run prints the bin dir.
#   bash scripts/llamacpp/build.sh            # -> prints the folder holding llama-completion, llama-bench, ...
# Environment: LLAMACPP_PY_VERSION (default 0.3.36), STAGEDSPEC_CACHE (default ~/.cache/stagedspec),
#              JOBS (default: nproc).
set -euo pipefail
version="${LLAMACPP_PY_VERSION:-0.3.36}"
cache="${STAGEDSPEC_CACHE:-$HOME/.cache/stagedspec}/llama.cpp-$version"
bin="$cache/build/bin"
targets=(llama-completion llama-speculative llama-bench llama-server)
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-completion" ]; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
if [ ! -d "$cache/src" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$cache/src"
  rm -rf "$tmp"
fi
cmake -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$cache/build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" >&2
echo "$bin"
