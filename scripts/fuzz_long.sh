#!/usr/bin/env bash
# The long fuzz run (docs/reliability.md, "Fuzzing"): each named harness, already built by
# scripts/fuzz.sh, with JOBS workers for SECONDS, from its seeds and the corpus of earlier runs,
# crashes counted and the run going on after one. Prints one line per harness: executions,
# coverage, corpus, crashes, seconds. Exit status 1 if any crashed (reproducers in
# $BUILD/artifacts/<name>/).
#
# Two ways to spread the jobs:
# - default: libFuzzer's fork mode (-fork=JOBS -ignore_crashes=1), one parent merging the corpus.
# - --pinned: JOBS independent libFuzzer processes, process j pinned to CPU j (taskset), sharing
#   the corpus folder (libFuzzer re-reads it every second: -reload=1); a process that crashes is
#   started again for the time left. For the threaded RPC harnesses: pinned, a process's threads
#   never migrate, so their stacks' unmapping does not flush the TLBs of the other cores (on the
#   16-core host, fork mode ran fuzz_coordinator_service at about 40 inputs a second per core).
#   The CPUs are DSA_FUZZ_FIRST_CPU (default 0) onwards, and the processes run with `ulimit -s`
#   of DSA_FUZZ_STACK_KB (default 1024): glibc then keeps the threads' 1 MiB stacks for reuse
#   instead of mapping and unmapping 8 MiB ones (23% more inputs of the coordinator's harness).
#
# usage: bash scripts/fuzz_long.sh [--pinned] SECONDS JOBS NAME...   (NAME: fuzz_tensor_codec, ...)
# Binaries from ${DSA_FUZZ_BUILD_DIR:-build-fuzz}/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
pinned=0
if [ "${1:-}" = "--pinned" ]; then
  pinned=1
  shift
fi
seconds=$1
jobs=$2
shift 2
build=${DSA_FUZZ_BUILD_DIR:-build-fuzz}
failed=0
# shellcheck source=scripts/fuzz_corpus.sh
source scripts/fuzz_corpus.sh
for name in "$@"; do
  prepare_corpus "$name" "$build"
  corpus=$build/corpus/$name
  artifacts=$build/artifacts/$name
  log=$build/$name.long.log
  start=$(date +%s)
  if [ "$pinned" = 0 ]; then
    "$build/bin/$name" -fork="$jobs" -ignore_crashes=1 -max_total_time="$seconds" \
      -artifact_prefix="$artifacts/" -rss_limit_mb=4096 "$corpus" >"$log" 2>&1 || true
    took=$(($(date +%s) - start))
    # Fork mode's status lines: "#EXECS: cov: C ft: F corp: N exec/s: E oom/timeout/crash: O/T/X"
    last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -1 || true)
    execs=$(sed -nE 's/^#([0-9]+):.*/\1/p' <<<"$last")
    cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
    corp=$(sed -nE 's/.* corp: ([0-9]+).*/\1/p' <<<"$last")
    crashes=$(sed -nE 's#.*oom/timeout/crash: ([0-9]+)/([0-9]+)/([0-9]+).*#\1 oom, \2 timeouts, \3 crashes#p' <<<"$last")
  else
    end=$((start + seconds))
    rm -f "$log".*
    first_cpu=${DSA_FUZZ_FIRST_CPU:-0}
    for ((j = 0; j < jobs; j++)); do
      (
        ulimit -s "${DSA_FUZZ_STACK_KB:-1024}"
        n=0
        while [ "$(date +%s)" -lt "$end" ]; do
          taskset -c "$((first_cpu + j))" "$build/bin/$name" -max_total_time=$((end - $(date +%s))) \
            -print_final_stats=1 -artifact_prefix="$artifacts/" -rss_limit_mb=4096 "$corpus" \
            >"$log.$j.$n" 2>&1 || true
          n=$((n + 1))
        done
      ) &
    done
    wait
    took=$(($(date +%s) - start))
    # Each process's executions: its final stats, or (one that crashed) its last status line
    # "#EXECS <event> cov: C ft: F corp: N/..."; a crash, an OOM or a timeout ends a process with
    # "ERROR: libFuzzer: ..." or a sanitizer's "SUMMARY:".
    execs=0 crashed=0 cov=0
    for f in "$log".*; do
      e=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$f" | tail -1)
      [ -n "$e" ] || e=$(grep -oE '^#[0-9]+' "$f" | tail -1 | tr -d '#')
      execs=$((execs + ${e:-0}))
      c=$(grep -oE ' cov: [0-9]+' "$f" | tail -1 | grep -oE '[0-9]+' || true)
      [ "${c:-0}" -gt "$cov" ] && cov=$c
      grep -qE '^(==[0-9]+== ?ERROR: libFuzzer|SUMMARY: )' "$f" && crashed=$((crashed + 1))
    done
    corp=$(find "$corpus" -type f | wc -l)
    crashes="$crashed crashes, OOMs or timeouts"
    cov="$cov (largest of one process)"
  fi
  echo "fuzz_long: $name: ${execs:-?} executions, coverage ${cov:-?} edges, corpus ${corp:-?}, ${crashes:-? crashes}, ${took} s, $jobs jobs"
  if [ -n "$(ls -A "$artifacts")" ]; then
    echo "fuzz_long: $name left reproducers in $artifacts/:" >&2
    ls "$artifacts" >&2
    failed=1
  fi
done
exit "$failed"
