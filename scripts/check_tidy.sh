#!/usr/bin/env bash
# Runs clang-tidy (.clang-tidy; warnings are errors) over the library and tool sources, using the
# compile commands of the build in ${DSA_BUILD_DIR:-build}. Tests, benchmarks and the fuzz harnesses
# (built only with clang, scripts/fuzz.sh) are not checked.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSA_BUILD_DIR:-build}
mapfile -t files < <(git ls-files '*.cc' | grep -v -E '^(tests|bench|fuzz)/')
# clang-tidy counts the warnings it suppressed in system headers on stderr: drop those lines only.
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$build_dir" --quiet 2>&1 |
  { grep -v -E '^[0-9]+ warnings? generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter' || true; }
echo "check_tidy: ${#files[@]} files clean"
