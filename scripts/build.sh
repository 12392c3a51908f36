#!/usr/bin/env bash
# Configures and builds the project into build/ (Release, Ninja, ccache when present).
# Extra arguments, and the words of $DSA_CMAKE_ARGS, go to the CMake configure step, e.g.
# DSA_CMAKE_ARGS=-DDSA_ENABLE_CUDA=OFF bash scripts/test.sh. $DSA_BUILD_TARGETS (space-separated)
# builds only those targets (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSA_BUILD_DIR:-build}
jobs=${DSA_BUILD_JOBS:-$(nproc)}
mkdir -p "$build_dir"
# shellcheck disable=SC2086
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${DSA_CMAKE_ARGS:-} "$@" >"$build_dir/configure.log" 2>&1 || {
  cat "$build_dir/configure.log" >&2
  exit 1
}
# shellcheck disable=SC2086
cmake --build "$build_dir" -j "$jobs" ${DSA_BUILD_TARGETS:+--target $DSA_BUILD_TARGETS}
