#!/usr/bin/env bash
# The rules and dashboards against a real Prometheus: `dsa up` on loopback, Debian's `prometheus`
# scraping every server's /metrics each second with deploy/observability/rules/dsa-rules.yaml
# evaluated each second, a short `dsa replay`, then what Prometheus says checked against the
# replay's report: counters exactly, recorded ratios within stated tolerances; every family of
# deploy/observability/metrics.txt present, every rule evaluated without error, every dashboard
# query answered with data.
# Usage: prometheus_rules_test.sh BIN_DIR TRACE_FILE. Exits 77 (skipped) when `prometheus` is not
# on PATH. DSA_RULES_FILE replaces the rules file (e.g. the chart's copy). Needs python3 (standard
# library only). Stops every process it started on exit.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BIN_DIR TRACE_FILE" >&2
  exit 2
fi
bin_dir=$(cd "$1" && pwd)
trace=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
repo=$(cd "$(dirname "$0")/../.." && pwd)
obs=$repo/deploy/observability
rules=${DSA_RULES_FILE:-$obs/rules/dsa-rules.yaml}
rules=$(cd "$(dirname "$rules")" && pwd)/$(basename "$rules")

if ! command -v prometheus >/dev/null 2>&1; then
  echo "SKIP: prometheus is not on PATH (Debian: apt-get install --no-install-recommends prometheus)"
  exit 77
fi
for f in "$bin_dir/dsa" "$trace" "$rules"; do
  if [ ! -e "$f" ]; then
    echo "prometheus_rules_test: $f does not exist" >&2
    exit 2
  fi
done

tmp=$(mktemp -d)
up_pid=""
prom_pid=""
status=1

# Stops Prometheus, then `dsa up` (SIGTERM: it stops its cluster in order), then any server of
# the cluster still alive (by the pids `dsa up` printed). Keeps the logs when the test failed.
cleanup() {
  local pid
  if [ -n "$prom_pid" ] && kill -0 "$prom_pid" 2>/dev/null; then
    kill -TERM "$prom_pid" 2>/dev/null || true
    wait "$prom_pid" 2>/dev/null || true
  fi
  if [ -n "$up_pid" ] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid" 2>/dev/null || true
    for _ in $(seq 1 200); do
      kill -0 "$up_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
  fi
  if [ -f "$tmp/up.err" ]; then
    for pid in $(sed -n 's/^ *dsa-[a-z0-9-]* *pid \([0-9]*\) .*/\1/p' "$tmp/up.err"); do
      kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  if [ "$status" -eq 0 ]; then
    rm -rf "$tmp"
  else
    echo "prometheus_rules_test: FAILED; logs in $tmp" >&2
  fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.2 s.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "prometheus_rules_test: no $what within ${seconds} s" >&2
      return 1
    fi
    sleep 0.2
  done
}

# 1. The cluster. Auditing on, so that the miss ratio has rows, and a miss target, so that the
# indexers export dsa_indexer_miss_target_ratio (no series without one) for the alert to judge
# against.
"$bin_dir/dsa" up --bin-dir "$bin_dir" --log-dir "$tmp/cluster" --audit-fraction 0.25 \
  --indexer-arg=--miss-target=0.2 >"$tmp/up.out" 2>"$tmp/up.err" &
up_pid=$!
cluster_ready() {
  kill -0 "$up_pid" 2>/dev/null || { cat "$tmp/up.err" >&2; exit 1; }
  grep -q "coordinator listening on" "$tmp/up.out"
}
wait_for 180 "'dsa up: coordinator listening on'" cluster_ready
coordinator=$(sed -n 's/.*coordinator listening on \([^ ]*\).*/\1/p' "$tmp/up.out")
cat "$tmp/up.err"

# 2. Prometheus: one job a component (their names have "dsa", as DsaTargetDown expects), a
# namespace label as Kubernetes would add.
targets() { sed -n "s/^ *$1[a-z0-9-]* .* metrics \([^ ]*\) .*/\1/p" "$tmp/up.err"; }
{
  echo "global:"
  echo "  scrape_interval: 1s"
  echo "  scrape_timeout: 900ms"
  echo "  evaluation_interval: 1s"
  echo "rule_files:"
  echo "  - $rules"
  echo "scrape_configs:"
  for job in dsa-coordinator dsa-indexer dsa-attention; do
    echo "  - job_name: $job"
    echo "    static_configs:"
    echo "      - labels: {namespace: dsa-integration}"
    echo "        targets:"
    for target in $(targets "$job"); do echo "          - $target"; done
  done
} >"$tmp/prometheus.yml"
if [ "$(grep -c '^          - ' "$tmp/prometheus.yml")" -lt 3 ]; then
  echo "prometheus_rules_test: found fewer than 3 metrics addresses in dsa up's output" >&2
  exit 1
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
prom_url=http://127.0.0.1:$port
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address="127.0.0.1:$port" >"$tmp/prometheus.log" 2>&1 &
prom_pid=$!

# prom QUERY: prints the instant query's result as JSON (python3, standard library).
prom_ready() {
  kill -0 "$prom_pid" 2>/dev/null || { cat "$tmp/prometheus.log" >&2; exit 1; }
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/-/ready", timeout=2)' \
    "$prom_url" 2>/dev/null
}
wait_for 60 "Prometheus ready at $prom_url" prom_ready
# Every target scraped once before the replay, so that rates start from the counters' zero.
targets_up() {
  python3 - "$prom_url" <<'EOF'
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/api/v1/targets?state=active", timeout=2) as r:
    targets = json.load(r)["data"]["activeTargets"]
sys.exit(0 if len(targets) >= 3 and all(t["health"] == "up" for t in targets) else 1)
EOF
}
wait_for 30 "scrape of every target" targets_up

# 3. The replay (speculative decoding on, so that acceptance has drafts).
"$bin_dir/dsa" replay --coordinator "$coordinator" --trace "$trace" --limit 20 \
  --max-context 2048 --max-output 8 --time-scale 0 --draft-length 2 \
  --json "$tmp/report.json" >"$tmp/replay.md" 2>"$tmp/replay.err" || {
  cat "$tmp/replay.err" >&2
  exit 1
}
tail -n 1 "$tmp/replay.err"

# 4. Prometheus against the report.
python3 - "$prom_url" "$tmp/report.json" "$obs" <<'EOF'
"""Waits for Prometheus to scrape the replay's counters and evaluate the rules, then checks."""
import json
import pathlib
import sys
import time
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True
prom_url, report_path, obs = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
sys.path.insert(0, str(obs))
from check_queries import dashboard_queries, load_metrics, plain_promql  # noqa: E402

report = json.loads(pathlib.Path(report_path).read_text())
failures = []


def api(path, **params):
    url = f"{prom_url}/api/v1/{path}?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def query(expr):
    """The instant vector's samples as {frozenset(labels): value}."""
    data = api("query", query=expr)
    return {frozenset(s["metric"].items()): float(s["value"][1]) for s in data["result"]}


def scalar(expr):
    """The value of a one-sample query, or None when it has none."""
    samples = query(expr)
    if len(samples) > 1:
        raise RuntimeError(f"{expr}: {len(samples)} samples, expected one")
    return next(iter(samples.values()), None)


def wait_for(what, predicate, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    failures.append(f"timed out waiting for {what}")
    return False


def check_exact(what, expr, expected):
    got = scalar(expr)
    ok = got is not None and got == float(expected)
    print(f"{'ok  ' if ok else 'FAIL'} {what}: Prometheus {got}, report {expected}  [{expr}]")
    if not ok:
        failures.append(f"{what}: Prometheus {got} != report {expected}")


def check_close(what, expr, expected, tolerance, why):
    got = scalar(expr)
    ok = got is not None and expected is not None and abs(got - expected) <= tolerance
    print(f"{'ok  ' if ok else 'FAIL'} {what}: Prometheus {got}, report {expected}, "
          f"tolerance {tolerance} ({why})  [{expr}]")
    if not ok:
        failures.append(f"{what}: Prometheus {got} vs report {expected} (tolerance {tolerance})")


completed = report["requests"]["completed"]
# The scrape after the replay's last request, then a few evaluations of the rules.
wait_for("the completed requests' scrape",
         lambda: scalar('sum(dsa_coordinator_requests_total{outcome="completed"})') == completed)
time.sleep(3)
wait_for("the recording rules' first values",
         lambda: scalar("dsa:indexer_realized_block_sparsity:ratio_rate5m") is not None)

# Counters: exact (the report sums what the coordinator streamed to the client).
check_exact("completed requests", 'sum(dsa_coordinator_requests_total{outcome="completed"})',
            completed)
check_exact("requests, every outcome", "sum(dsa_coordinator_requests_total)",
            report["requests"]["total"])
check_exact("first tokens (TTFT observations)",
            "sum(dsa_coordinator_time_to_first_token_seconds_count)", completed)
check_exact("generated tokens", "sum(dsa_coordinator_generated_tokens_total)",
            report["throughput"]["generated_tokens"])
check_exact("blocks scored", "sum(dsa_indexer_blocks_scored_total)",
            report["indexer"]["blocks_scored"])
check_exact("blocks visible", "sum(dsa_indexer_blocks_visible_total)",
            report["indexer"]["blocks_visible"])
check_exact("audited rows", "sum(dsa_indexer_audited_miss_ratio_count)",
            report["indexer"]["audited_rows"])
check_exact("draft tokens", "sum(dsa_coordinator_spec_decode_draft_tokens_total)",
            report["speculative_decoding"]["drafted_tokens"])
check_exact("accepted draft tokens", "sum(dsa_coordinator_spec_decode_accepted_tokens_total)",
            report["speculative_decoding"]["accepted_tokens"])

# Recorded ratios. Both counters of a ratio come from one target, scraped at the same instants,
# so rate()'s extrapolation is the same factor above and below the line and cancels; the window
# (5 or 10 minutes) holds the whole run from the counters' zero. What is left is floating-point
# rounding (the miss ratio's sum is added up in another order on each side).
why = "one target's counters, the same extrapolation; float rounding only"
check_close("realized block sparsity", "dsa:indexer_realized_block_sparsity:ratio_rate5m",
            report["indexer"]["realized_block_sparsity"], 1e-9, why)
check_close("audited miss ratio, mean", "dsa:indexer_audited_miss_ratio:mean_rate10m",
            report["indexer"]["audited_miss_rate"], 1e-6, why)
check_close("speculative acceptance", "dsa:coordinator_spec_decode_acceptance:ratio_rate5m",
            report["speculative_decoding"]["acceptance"], 1e-9, why)
# The indexers' --miss-target as the alert reads it (`dsa up --indexer-arg=--miss-target=0.2`):
# the job's, and what the alert judges against (the job's, not the fallback).
check_exact("miss target", "dsa:indexer_miss_target_ratio:max", 0.2)
check_exact("effective miss target", "dsa:indexer_miss_target_ratio:effective", 0.2)

# Every family of the contract is exported (histograms as _count).
families = load_metrics(obs / "metrics.txt")
names = {dict(labels)["__name__"] for labels in query('count by (__name__) ({__name__=~".+"})')}
# External families (NVIDIA's DCGM exporter) come from exporters this test does not run.
external = {f.name for f in families.values() if f.kind == "external"}
missing = sorted(f.name for f in families.values() if f.name not in external
                 and (f.name + "_count" if f.kind == "histogram" else f.name) not in names)
print(f"{'ok  ' if not missing else 'FAIL'} contract families exported: "
      f"{len(families) - len(external) - len(missing)} of {len(families) - len(external)}")
if missing:
    failures.append(f"families of metrics.txt no server exports: {', '.join(missing)}")
jobs = {dict(labels).get("job") for labels in query("count by (job) (dsa_build_info)")}
if jobs != {"dsa-coordinator", "dsa-indexer", "dsa-attention"}:
    failures.append(f"dsa_build_info from the jobs {sorted(j for j in jobs if j)}, not all three")

# Every rule evaluated without error.
bad_rules = [f"{r['name']}: {r.get('lastError')}"
             for g in api("rules")["groups"] for r in g["rules"] if r.get("health") != "ok"]
print(f"{'ok  ' if not bad_rules else 'FAIL'} rules evaluated without error")
failures += [f"rule {r}" for r in bad_rules]
pending = sorted({a["labels"]["alertname"] + " (" + a["state"] + ")"
                  for a in api("alerts")["alerts"]})
print(f"     alerts pending or firing (information): {', '.join(pending) or 'none'}")

# Every dashboard query answers with data (the replay made every kind of series).
empty = []
for path in sorted((obs / "dashboards").glob("*.json")):
    for where, expr in dashboard_queries(path):
        if any(name in expr for name in external):
            continue  # the GPU panels: no DCGM exporter here
        if not query(plain_promql(expr)):
            empty.append(f"{where}: {expr}")
print(f"{'ok  ' if not empty else 'FAIL'} dashboard queries with data ({len(empty)} empty)")
failures += [f"no data: {e}" for e in empty]

for failure in failures:
    print(f"prometheus_rules_test: {failure}", file=sys.stderr)
sys.exit(1 if failures else 0)
EOF
status=0
echo "prometheus_rules_test: OK"
