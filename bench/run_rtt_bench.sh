#!/usr/bin/env bash
# Runs bench_select_stream_rtt and writes docs/results/select_stream_rtt.{json,md} with the
# machine, load, commit and the exact command.
#
# Usage: bench/run_rtt_bench.sh [extra flags for the benchmark...]
# Environment: BUILD_DIR (default build), OUT_DIR (default docs/results), BIN (the binary, default
#              $BUILD_DIR/bin/bench_select_stream_rtt; set it to run a prebuilt one elsewhere).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
OUT_DIR=${OUT_DIR:-$ROOT/docs/results}
BIN=${BIN:-$BUILD_DIR/bin/bench_select_stream_rtt}
mkdir -p "$OUT_DIR"
if [[ ! -x $BIN ]]; then
  cmake --build "$BUILD_DIR" --target bench_select_stream_rtt
fi
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
TABLE=$("$BIN" --json "$OUT_DIR/select_stream_rtt.json" "$@")
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
{
  echo "# Per-layer select round trip on the gRPC SelectStream (loopback)"
  echo
  echo "- command: \`bench/run_rtt_bench.sh $*\`"
  echo "- machine: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores"
  echo "- load average: $LOAD_BEFORE (before) / $LOAD_AFTER (after)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "$TABLE"
} >"$OUT_DIR/select_stream_rtt.md"
cat "$OUT_DIR/select_stream_rtt.md"
