#!/usr/bin/env bash
# Shell functions the device scripts share (scripts/gpu_feature, scripts/gpu_pair, scripts/gpu_round), sourced
# from the repo root.  Why: each run carries its files to a lent GPU in calls of at most 64 MiB, with the working
# tree; the steps of getting there (wheels the device lacks, big files cut into parts, what the device does not need
# set aside and put back) are the same for every run, and a slip in one copy costs a session's device time.

ASIDE=${ASIDE:-/tmp/stagedspec-aside}
PY_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# Folders that must never be committed nor copied twice: ignored through .git/info/exclude, not .gitignore.
exclude_here() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for d in "$@"; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
}

# Wheels for the device's Python (3.12) into .whl/, for what it lacks.
download_wheels() {
  python3 -m pip download -q --no-deps "${PY_TAGS[@]}" -d .whl "$@"
}

# Move the given paths to $ASIDE (set_aside) or back (put_back): the working tree travels with every call.
set_aside() {
  for p in "$@"; do
    if [ -e "$p" ]; then mkdir -p "$ASIDE/$(dirname "$p")" && rm -rf "${ASIDE:?}/$p" && mv "$p" "$ASIDE/$p"; fi
  done
}
put_back() {
  for p in "$@"; do
    if [ -e "$ASIDE/$p" ]; then mkdir -p "$(dirname "$p")" && rm -rf "$p" && mv "$ASIDE/$p" "$p"; fi
  done
}

# Standard input cut into parts of $2 bytes, each in a folder of its own ($1/p0, $1/p1, ...): one part a call.
# Prints the number of parts.
split_into_calls() {
  local dir=$1 bytes=$2 n=0
  rm -rf "$dir" && mkdir -p "$dir"
  split -b "$bytes" -d -a 2 - "$dir/part"
  for f in "$dir"/part*; do mkdir -p "$dir/p$n" && mv "$f" "$dir/p$n/"; n=$((n + 1)); done
  echo "$n"
}

# What one call carries: the working tree git would copy, the wheels, and the biggest part folder ($1).
carried_mib() {
  local tree wheels biggest
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
  wheels=$(du -cb .whl/* 2>/dev/null | tail -1 | cut -f1 || true)
  biggest=$(du -cb "$1"/* | tail -1 | cut -f1)
  echo $(( (tree + ${wheels:-0} + biggest) / 1048576 ))
}

# On the device: keep carried part folder $1/p$2 in $3; the first call also installs the carried wheels ($4: a
# glob under .whl) into $SITE.
keep_part() {
  local dir=$1 n=$2 into=$3 wheels=${4:-*.whl}
  mkdir -p "$into" && mv "$dir/p$n"/* "$into/" || return 1
  if [ "$n" = 0 ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:?}" .whl/$wheels \
      || return 1
    nvidia-smi -L || true  # a CPU smoke run has none
  fi
}
