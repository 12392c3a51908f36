#!/usr/bin/env bash
# The Helm chart's CI check: renders helm/dsa-indexer with Helm's own engine for the default
# values, every example and the other branches, validates every object (Kubernetes schemas,
# Prometheus Operator CRD schemas), checks what the chart and each example promise and that bad
# values are refused (helm/tests/render_and_validate.py; docs/deploy.md, "The Helm chart").
# Offline once scripts/python_tools.sh has made the tools' venv.
# Usage: bash scripts/check_chart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)
"$bin/python" helm/tests/render_and_validate.py
