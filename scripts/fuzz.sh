#!/usr/bin/env bash
# Builds the libFuzzer harnesses under fuzz/ with clang-14 (ASan + UBSan, the tree instrumented)
# into build-fuzz/ and runs each from its seeds (fuzz/seeds/<name>/; text-format protobuf seeds are
# encoded with protoc first). Fails on any crash, leak or sanitizer report (the reproducer is left
# in build-fuzz/artifacts/<name>/).
#
# usage: bash scripts/fuzz.sh [SECONDS]        each harness for SECONDS (default 20; CI's short run)
#        bash scripts/fuzz.sh --runs N          each harness for N executions (the long run)
# Each run's last libFuzzer stats line (executions, coverage, corpus) is printed; docs/reliability.md
# has the long run's figures.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=(-max_total_time="${1:-20}")
if [ "${1:-}" = "--runs" ]; then limit=(-runs="$2"); fi
build=${DSA_FUZZ_BUILD_DIR:-build-fuzz}
harnesses="fuzz_tensor_codec fuzz_mooncake_trace fuzz_azure_trace fuzz_indexer_service fuzz_attention_service
  fuzz_coordinator_service"
CC=clang-14 CXX=clang++-14 DSA_BUILD_DIR=$build \
  DSA_CMAKE_ARGS="-DDSA_FUZZ=ON -DDSA_ENABLE_CUDA=OFF -DDSA_BUILD_TESTS=ON -DDSA_BUILD_BENCH=OFF" \
  DSA_BUILD_TARGETS="$(echo $harnesses)" bash scripts/build.sh
# shellcheck source=scripts/fuzz_corpus.sh
source scripts/fuzz_corpus.sh
for name in $harnesses; do
  prepare_corpus "$name" "$build"
  corpus=$build/corpus/$name
  artifacts=$build/artifacts/$name
  log=$build/$name.log
  if ! "$build/bin/$name" "${limit[@]}" -print_final_stats=1 -artifact_prefix="$artifacts/" \
      -rss_limit_mb=4096 "$corpus" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "fuzz: $name failed (reproducer in $artifacts/; log $log)" >&2
    exit 1
  fi
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || echo "?")
  echo "fuzz: $name: $runs executions, coverage $cov edges, corpus $(ls "$corpus" | wc -l) inputs, no crash"
done
