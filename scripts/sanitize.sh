#!/usr/bin/env bash
# The engine and service test suites under AddressSanitizer + UndefinedBehaviorSanitizer (issue 13,
# docs/reliability.md "Sanitizers"): built with clang-14 in build-fuzz/ (the same instrumented
# build the libFuzzer harnesses use: -fsanitize=address,undefined, no recovery, so their libraries
# are compiled once for both) and run with CTest. Any sanitizer report fails its test, so the
# script fails.
#
# usage: bash scripts/sanitize.sh            the suites below (CI)
#        DSA_SANITIZE_TESTS=all bash scripts/sanitize.sh   every host suite, the binaries' too
# The suites: every engine (indexer, SPIN, top-K, block pool, attention engine, scheduler, the
# coordinator's engine over in-memory workers), the indexer and attention services in-process, the
# codec, the transports without a GPU, security, the trace readers.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DSA_FUZZ_BUILD_DIR:-build-fuzz}
suites="common_fp8_test common_philox_test common_mli_schedule_test common_status_macros_test
  common_trace_context_test proto_tensor_codec_test block_pool_test scoring_test topk_test spin_test
  indexer_test grpc_service_test transport_grpc_stream_test transport_nccl_wire_test
  attention_engine_test attention_service_test attention_mla_kv_test
  attention_mla_sparse_attention_test coordinator_scheduler_test coordinator_engine_test
  server_security_test tools_trace_test"
targets=$suites
regex="^($(echo $suites | tr ' ' '|'))\\."
if [ "${DSA_SANITIZE_TESTS:-}" = all ]; then targets=""; regex="."; fi
# shellcheck disable=SC2086
CC=clang-14 CXX=clang++-14 DSA_BUILD_DIR=$build \
  DSA_CMAKE_ARGS="-DDSA_FUZZ=ON -DDSA_ENABLE_CUDA=OFF -DDSA_BUILD_TESTS=ON -DDSA_BUILD_BENCH=OFF" \
  DSA_BUILD_TARGETS="$(echo $targets)" bash scripts/build.sh
# halt_on_error: the first report ends the process with a failure; detect_leaks: LeakSanitizer
# at exit; the suppressions name leaks of the uninstrumented system gRPC, never ours.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900 -R "$regex" \
  -E 'integration_prometheus_rules_test'
echo "sanitize: every selected suite passed under ASan + UBSan"
