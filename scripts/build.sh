#!/usr/bin/env bash
# Configures and builds the project into build/ (Release, Ninja, ccache when present).
# Extra arguments, and the words of $DSA_CMAKE_ARGS, go to the CMake configure step, e.g.
# DSA_CMAKE_ARGS=-DDSA_ENABLE_CUDA=OFF bash scripts/test.sh. $DSA_BUILD_TARGETS (space-separated)
# builds only those targets (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSA_BUILD_DIR:-build}
# Paths under the checkout hash as relative ones, so that a fresh clone elsewhere (CI's) hits the
# cache that an earlier clone filled.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
# The instrumented builds (-g): their debug info then names the first clone's build folder, and
# stack traces the sources relative to it, which is what a report needs.
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
jobs=${DSA_BUILD_JOBS:-$(nproc)}
mkdir -p "$build_dir"
# shellcheck disable=SC2086
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${DSA_CMAKE_ARGS:-} "$@" >"$build_dir/configure.log" 2>&1 || {
  cat "$build_dir/configure.log" >&2
  exit 1
}
# shellcheck disable=SC2086
cmake --build "$build_dir" -j "$jobs" ${DSA_BUILD_TARGETS:+--target $DSA_BUILD_TARGETS}
