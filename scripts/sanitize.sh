#!/usr/bin/env bash
# The host test suite under AddressSanitizer + UndefinedBehaviorSanitizer (issue 13,
# docs/reliability.md "Sanitizers"): the tree and its tests built with clang-14 in build-fuzz/ (the
# same instrumented build the libFuzzer harnesses use: -fsanitize=address,undefined, no recovery)
# and run with CTest. Any sanitizer report fails its test, so the script fails.
#
# usage: bash scripts/sanitize.sh [CTEST_ARGS...]     e.g. -R indexer_ to run a subset
# Left out (-E): the real-Prometheus test (a shell script), and the GPU tests (CUDA is off here).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DSA_FUZZ_BUILD_DIR:-build-fuzz}
CC=clang-14 CXX=clang++-14 DSA_BUILD_DIR=$build \
  DSA_CMAKE_ARGS="-DDSA_FUZZ=ON -DDSA_ENABLE_CUDA=OFF -DDSA_BUILD_TESTS=ON -DDSA_BUILD_BENCH=OFF" \
  bash scripts/build.sh
# halt_on_error: the first report ends the process with a failure; detect_leaks: LeakSanitizer
# at exit; the suppressions name leaks of the uninstrumented system gRPC, never ours.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900 \
  -E 'integration_prometheus_rules_test' "$@"
echo "sanitize: the host suite passed under ASan + UBSan"
