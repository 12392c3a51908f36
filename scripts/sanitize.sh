#!/usr/bin/env bash
# The engine and service test suites under AddressSanitizer + UndefinedBehaviorSanitizer (docs/reliability.md,
# docs/reliability.md "Sanitizers"): built with clang-14 in build-fuzz/ (the same instrumented
# build the libFuzzer harnesses use: -fsanitize=address,undefined, no recovery, so their libraries
# are compiled once for both) and run with CTest. Any sanitizer report fails its test, so the
# script fails.
#
# usage: bash scripts/sanitize.sh            the suites below (CI)
#        DSA_SANITIZE_TESTS=all bash scripts/sanitize.sh   every target built, every test run
# The suites: every host suite: the engines, the services in-process, the codec, the transports
# without a GPU, security, flags, the trace readers, replay and eval, and the suites that start
# the server binaries (built under ASan too, as their dependencies): the binaries' own tests, the
# local cluster, faults, security and chaos (kill -9 and SIGSTOP mid-replay).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DSA_FUZZ_BUILD_DIR:-build-fuzz}
suites="common_fp8_test common_philox_test common_mli_schedule_test common_status_macros_test
  common_trace_context_test proto_tensor_codec_test block_pool_test scoring_test topk_test spin_test
  indexer_test indexer_edge_cases_test indexer_requests_test grpc_service_test
  grpc_service_errors_test
  transport_grpc_stream_test transport_nccl_wire_test
  attention_engine_test attention_service_test attention_service_errors_test attention_mla_kv_test
  attention_mla_sparse_attention_test coordinator_scheduler_test coordinator_engine_test
  server_security_test tools_trace_test
  attention_pattern_model_test tools_predictor_study_test attention_rotation_cos_sin_test
  attention_sparse_attention_test coordinator_acceptance_model_test coordinator_migration_test
  coordinator_service_test coordinator_service_workers_test coordinator_with_attention_test
  indexer_device_test server_flags_test
  tools_eval_test tools_replay_test transport_dsa_indexer_data_plane_test
  dsa_indexer_binary_test dsa_attention_binary_test dsa_coordinator_binary_test
  integration_local_cluster_test integration_faults_test integration_security_test
  integration_chaos_test integration_lease_test coordinator_lease_test attention_llama_model_test attention_llama_model_loader_test
  attention_llama_engine_test attention_sampler_test
  coordinator_real_model_engine_test coordinator_ngram_drafter_test coordinator_token_blocks_test"
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
