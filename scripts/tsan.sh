#!/usr/bin/env bash
# The engine suites under ThreadSanitizer (docs/reliability.md "Sanitizers").
#
# Every engine locks with absl::Mutex, and Debian's libabsl is built without TSan's annotations, so
# TSan sees no happens-before through it and reports every guarded access as a race. This script
# therefore builds Debian's own Abseil (the source package of the installed libabsl-dev version,
# Debian's patches applied: same options, same SONAMEs, same ABI) with -fsanitize=thread into
# $build/abseil, builds the suites against it with clang-14 -fsanitize=thread (-DDSA_TSAN=ON), and
# runs them with that Abseil first on the library path, so every absl::Mutex of the process,
# system gRPC's too, is seen. The suites run engines over in-memory collaborators; the cases that
# cross the system gRPC (uninstrumented: a hand-off through its completion queues is invisible to
# TSan) are filtered out by name. OMP_NUM_THREADS=1: libgomp is not instrumented either.
#
# usage: bash scripts/tsan.sh       (CI: after scripts/bootstrap.sh, which installs clang-14,
#                                    libclang-rt-14-dev, and dpkg-dev with build-essential)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DSA_TSAN_BUILD_DIR:-build-tsan}
mkdir -p "$build"
build=$(cd "$build" && pwd)
jobs=${DSA_BUILD_JOBS:-$(nproc)}
absl_version=$(dpkg-query -W -f='${Version}' libabsl-dev)
absl_prefix=$build/abseil
launcher=()
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
if command -v ccache >/dev/null; then launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
tsan_flags="-fsanitize=thread -O1 -g -fno-omit-frame-pointer"

if [ "$(cat "$absl_prefix/.version" 2>/dev/null)" != "$absl_version" ]; then
  # Debian's source package, from the deb-src twins of this machine's own apt sources (a private
  # apt state under $build/apt, so the system's lists are left alone).
  apt_dir=$build/apt
  rm -rf "$apt_dir" "$build/abseil-src" "$build/abseil-build" "$absl_prefix"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/sources.list.d" "$build/abseil-src"
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && sed -E 's/^Types:.*/Types: deb-src/' "$f" >"$apt_dir/sources.list.d/$(basename "$f")"
  done
  if [ -f /etc/apt/sources.list ]; then
    sed -nE 's/^deb (.*)/deb-src \1/p' /etc/apt/sources.list >"$apt_dir/sources.list.d/list.list"
  fi
  apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
    -o "Dir::State::Lists=$apt_dir/lists" -o "APT::Sandbox::User=root")
  apt-get "${apt_opts[@]}" -qq update
  (cd "$build/abseil-src" && apt-get "${apt_opts[@]}" -qq source --download-only "abseil=$absl_version")
  dsc=$(ls "$build"/abseil-src/abseil_*.dsc)
  dpkg-source --no-check -x "$dsc" "$build/abseil-src/tree" >/dev/null
  # As debian/rules configures the shared build, plus TSan.
  CC=clang-14 CXX=clang++-14 cmake -S "$build/abseil-src/tree" -B "$build/abseil-build" -G Ninja \
    -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_C_FLAGS="$tsan_flags" -DCMAKE_CXX_FLAGS="$tsan_flags" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread -DCMAKE_INSTALL_PREFIX="$absl_prefix" \
    -DCMAKE_INSTALL_LIBDIR=lib "${launcher[@]}" >"$build/abseil-configure.log" 2>&1 || {
    cat "$build/abseil-configure.log" >&2
    exit 1
  }
  cmake --build "$build/abseil-build" -j "$jobs"
  cmake --install "$build/abseil-build" >/dev/null
  echo "$absl_version" >"$absl_prefix/.version"
fi

# The suites: the scheduler, the coordinator's engine over in-memory workers (decode loops, worker
# watch, migration, drain: the most threads), the attention engine over in-process indexers, the
# CPU LlamaRunner (passes racing copies of their caches), the indexer engine and block pool, and
# common.
suites=(coordinator_scheduler_test coordinator_engine_test coordinator_real_model_engine_test
  attention_engine_test attention_llama_runner_test indexer_test indexer_edge_cases_test
  indexer_requests_test
  block_pool_test common_mli_schedule_test common_trace_context_test)
# tsan_mutex_canary: the check that TSan sees absl::Mutex at all (run first, below).
CC=clang-14 CXX=clang++-14 DSA_BUILD_DIR=$build/dsa \
  DSA_CMAKE_ARGS="-DDSA_TSAN=ON -DDSA_ENABLE_CUDA=OFF -DDSA_BUILD_TESTS=ON -DDSA_BUILD_BENCH=OFF -DCMAKE_PREFIX_PATH=$absl_prefix" \
  DSA_BUILD_TARGETS="tsan_mutex_canary ${suites[*]}" bash scripts/build.sh
# The cases that cross the system gRPC (a real channel and server).
declare -A exclude=([attention_engine_test]="EngineTransportsTest.InProcessAndGrpcIndexerClientsGiveIdenticalSelectionsAndOutputs")
export LD_LIBRARY_PATH=$absl_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMP_NUM_THREADS=1
# halt_on_error: the first report fails the suite; second_deadlock_stack: both stacks of a
# lock-order inversion; report_atomic_races=0: absl::Mutex's own wake-up (an atomic add on a
# thread identity that LowLevelAlloc mmapped) is reported as racing with the mmap, because TSan is
# told to ignore the synchronization inside the Mutex (the known false positive of
# google/sanitizers issue 953). It hides only races in which one access is atomic; every race
# between plain accesses, the kind a missing lock makes, is still reported.
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:report_atomic_races=0
# The suites' silence means something only if TSan sees through absl::Mutex (a guarded counter runs
# clean) and still sees a race (the same counter unguarded is reported).
canary=$build/dsa/bin/tsan_mutex_canary
if ! "$canary" guarded >"$build/canary_guarded.log" 2>&1; then
  cat "$build/canary_guarded.log" >&2
  echo "tsan: a counter guarded by absl::Mutex was reported: this Abseil is not TSan's" >&2
  exit 1
fi
if "$canary" unguarded >"$build/canary_unguarded.log" 2>&1 ||
  ! grep -q "WARNING: ThreadSanitizer: data race" "$build/canary_unguarded.log"; then
  echo "tsan: an unguarded counter was not reported: ThreadSanitizer is not working" >&2
  exit 1
fi
echo "tsan: the canary: guarded by absl::Mutex clean, unguarded reported"
for suite in "${suites[@]}"; do
  filter="*"
  if [ -n "${exclude[$suite]:-}" ]; then filter="*:-${exclude[$suite]}"; fi
  start=$SECONDS
  "$build/dsa/bin/$suite" --gtest_filter="$filter" --gtest_brief=1 >"$build/$suite.log" 2>&1 || {
    cat "$build/$suite.log" >&2
    echo "tsan: $suite failed (its log: $build/$suite.log)" >&2
    exit 1
  }
  echo "tsan: $suite passed ($(grep -Eo '[0-9]+ tests?' "$build/$suite.log" | tail -1), $((SECONDS - start)) s)"
done
echo "tsan: every selected suite passed under ThreadSanitizer"
