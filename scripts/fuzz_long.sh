#!/usr/bin/env bash
# The long fuzz run (docs/reliability.md, "Fuzzing"): each named harness, already built by
# scripts/fuzz.sh, in libFuzzer's fork mode with JOBS workers for SECONDS, from its seeds and the
# corpus of earlier runs, crashes counted and the run going on after one (-ignore_crashes). Prints
# one line per harness: executions, coverage, corpus, crashes, seconds. Exit status 1 if any crashed
# (reproducers in $BUILD/artifacts/<name>/).
#
# usage: bash scripts/fuzz_long.sh SECONDS JOBS NAME...   (NAME: fuzz_tensor_codec, ...)
# Binaries from ${DSA_FUZZ_BUILD_DIR:-build-fuzz}/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
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
  "$build/bin/$name" -fork="$jobs" -ignore_crashes=1 -max_total_time="$seconds" \
    -artifact_prefix="$artifacts/" -rss_limit_mb=4096 "$corpus" >"$log" 2>&1 || true
  took=$(($(date +%s) - start))
  # Fork mode's status lines: "#EXECS: cov: C ft: F corp: N exec/s: E oom/timeout/crash: O/T/X ..."
  last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -1 || true)
  execs=$(sed -nE 's/^#([0-9]+):.*/\1/p' <<<"$last")
  cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
  corp=$(sed -nE 's/.* corp: ([0-9]+).*/\1/p' <<<"$last")
  crashes=$(sed -nE 's#.*oom/timeout/crash: ([0-9]+)/([0-9]+)/([0-9]+).*#\1 oom, \2 timeouts, \3 crashes#p' <<<"$last")
  echo "fuzz_long: $name: ${execs:-?} executions, coverage ${cov:-?} edges, corpus ${corp:-?}, ${crashes:-? crashes}, ${took} s, $jobs jobs"
  if [ -n "$(ls -A "$artifacts")" ]; then
    echo "fuzz_long: $name left reproducers in $artifacts/:" >&2
    ls "$artifacts" >&2
    failed=1
  fi
done
exit "$failed"
