#!/usr/bin/env bash
# Lints the protos of proto/dsa with buf's STANDARD rules and the exceptions buf.yaml states (why
# each is kept). Offline: the module has no dependencies, so buf fetches nothing. buf comes from the
# pinned tools' venv (scripts/python_tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)
"$bin/buf" lint
echo "check_protos: buf lint passed ($("$bin/buf" --version), $(find proto/dsa -name '*.proto' | wc -l) files)"
