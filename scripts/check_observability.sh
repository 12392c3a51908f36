#!/usr/bin/env bash
# Checks deploy/observability/ (docs/deploy.md, "Dashboards and alerts"): the Prometheus rules
# (promtool check and unit tests), that the committed dashboards are what generate.py writes, that
# the chart's copies of both are identical, and every query against the metric contract
# (deploy/observability/check_queries.py). Needs promtool on PATH (Debian: the `prometheus`
# package) and the tools' venv (scripts/python_tools.sh). Exits non-zero on the first failing step.
# Usage: bash scripts/check_observability.sh
set -euo pipefail
cd "$(dirname "$0")/.."

obs=deploy/observability
rules=$obs/rules/dsa-rules.yaml
chart_rules=helm/dsa-indexer/files/prometheus-rules.yaml
chart_dashboards=helm/dsa-indexer/files/dashboards

if ! command -v promtool >/dev/null 2>&1; then
  echo "check_observability: promtool is not on PATH; install it (Debian: apt-get install" \
    "--no-install-recommends prometheus) or put Prometheus's promtool on PATH" >&2
  exit 2
fi
bin=$(bash scripts/python_tools.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step() { echo "== $*"; }

step "promtool check rules"
promtool check rules "$rules"

step "promtool test rules"
promtool test rules "$obs/rules/dsa-rules.test.yaml"

step "the chart's rules are the same file"
if ! cmp -s "$rules" "$chart_rules"; then
  diff -u "$rules" "$chart_rules" >&2 || true
  echo "check_observability: $chart_rules differs from $rules; copy it: cp $rules $chart_rules" >&2
  exit 1
fi

step "dashboards: generate.py's output is committed, here and in the chart"
"$bin/python" "$obs/dashboards/generate.py" --out "$tmp/dashboards"
for dir in "$obs/dashboards" "$chart_dashboards"; do
  # The JSON files only (the generator lives beside them in deploy/).
  if ! diff -r -x generate.py -x __pycache__ "$tmp/dashboards" "$dir" >"$tmp/diff"; then
    cat "$tmp/diff" >&2
    echo "check_observability: $dir is not what generate.py writes; run" \
      "\"\$(bash scripts/python_tools.sh)/python\" $obs/dashboards/generate.py" >&2
    exit 1
  fi
done

step "queries against the metric contract"
"$bin/python" "$obs/check_queries.py" --rules "$rules" --dashboards "$obs/dashboards" \
  --metrics "$obs/metrics.txt" --contract docs/deploy.md --promtool "$(command -v promtool)"

echo "check_observability: OK"
