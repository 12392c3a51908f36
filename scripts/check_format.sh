#!/usr/bin/env bash
# Fails when a tracked C++ or CUDA source differs from what clang-format (.clang-format) makes of it.
# With --fix, rewrites the files instead.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
else
  clang-format --dry-run --Werror "${files[@]}"
  echo "check_format: ${#files[@]} files formatted"
fi
