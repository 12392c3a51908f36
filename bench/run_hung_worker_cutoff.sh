#!/usr/bin/env bash
# How long a client waits when an attention worker hangs (SIGSTOP) mid-replay, with the
# coordinator's hung-worker cut-off (--hung-worker-checks 2) and without it (0: the step waits for
# the worker or --rpc-timeout-ms). A local cluster of 1 dsa-indexer and 2 dsa-attention replays the
# first 16 Mooncake requests (context <= 2,048, output 300, 8 streams, no drafts); 6 s in, the
# first dsa-attention is stopped for STOP_SECONDS, then resumed. The longest inter-token gap of the
# replay (inter_token_max) is the wait a client saw; docs/reliability.md has the figures.
#
# usage: bash bench/run_hung_worker_cutoff.sh [STOP_SECONDS]   (default 8; build/bin from
#        scripts/build.sh, or DSA_BIN_DIR). Results: docs/results/hung_worker_cutoff.md
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${DSA_BIN_DIR:-build/bin}")
stop_s=${1:-8}
out=docs/results/hung_worker_cutoff.md
work=$(mktemp -d)
victim=""
trap '[ -z "$victim" ] || kill -CONT "$victim" 2>/dev/null || true; rm -rf "$work"' EXIT
{
  echo "# An attention worker stopped for ${stop_s} s mid-replay"
  echo
  echo "\`bash bench/run_hung_worker_cutoff.sh ${stop_s}\` on $(nproc) cores, $(date -u +%Y-%m-%d)."
  echo "Coordinator: --worker-check-interval-ms 200 --worker-check-timeout-ms 500, --rpc-timeout-ms"
  echo "30000 (default)."
  echo
  echo "| --hung-worker-checks | completed / failed | migrations | first migration after the stop | inter-token p50 | inter-token max |"
  echo "|---|---|---|---|---|---|"
} >"$work/table.md"
for checks in 2 0; do
  run=$work/checks-$checks
  mkdir -p "$run/logs"
  "$bin/dsa" replay --local --bin-dir "$bin" --log-dir "$run/logs" --attention-workers 2 \
    --indexers 1 --trace data/traces/mooncake_conversation_trace.jsonl --limit 16 \
    --max-context 2048 --max-output 300 --time-scale 0 --max-in-flight 8 --draft-length 0 \
    --coordinator-arg=--worker-check-interval-ms=200 \
    --coordinator-arg=--worker-check-timeout-ms=500 \
    --coordinator-arg=--hung-worker-checks="$checks" \
    --json "$run/report.json" >"$run/replay.out" 2>&1 &
  replay=$!
  sleep 6
  # This replay's own first dsa-attention (a child of the dsa process), no other.
  victim=$(pgrep -o -P "$replay" -f "$bin/dsa-attention" || true)
  if [ -z "$victim" ]; then
    echo "no dsa-attention started by the replay (pid $replay) after 6 s" >&2
    kill "$replay" 2>/dev/null || true
    exit 1
  fi
  echo "hung-worker-checks $checks: SIGSTOP dsa-attention pid $victim for $stop_s s" >&2
  stopped_at=$(date +%s.%N)
  kill -STOP "$victim"
  sleep "$stop_s"
  kill -CONT "$victim"
  victim=""
  wait "$replay" || { tail -20 "$run/replay.out" >&2; exit 1; }
  python3 - "$run/report.json" "$checks" "$stopped_at" "$run/logs" >>"$work/table.md" <<'PY'
import datetime, glob, json, sys
r = json.load(open(sys.argv[1]))
q, l = r["requests"], r["latency_seconds"]
# The coordinator's first "migrating" log line (RFC 3339 ts), relative to the SIGSTOP.
first = None
for path in glob.glob(sys.argv[4] + "/*coordinator*"):
    for line in open(path, errors="replace"):
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("msg") == "migrating a request off a failed worker":
            ts = datetime.datetime.fromisoformat(entry["ts"].replace("Z", "+00:00")).timestamp()
            first = ts if first is None else min(first, ts)
after = "none" if first is None else f"{first - float(sys.argv[3]):.2f} s"
print(f"| {sys.argv[2]} | {q['completed']} / {q['failed']} | {q['migrations']} "
      f"({q['migrated_requests']} requests) | {after} | {l['inter_token_p50'] * 1e3:.1f} ms "
      f"| {l['inter_token_max']:.2f} s |")
PY
done
cp "$work/table.md" "$out"
cat "$out"
