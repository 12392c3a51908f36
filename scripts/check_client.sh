#!/usr/bin/env bash
# Checks the Python client (clients/python): the committed stubs equal a fresh generate.sh run,
# the client's unit tests against an in-process fake coordinator, and the example against a real
# local cluster (`dsa up`, skipped when build/bin, or $DSA_BIN_DIR, has no dsa). Runs with the
# pinned tools' venv (grpcio, grpcio-tools, protobuf; scripts/python_tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)
cd clients/python
PYTHONDONTWRITEBYTECODE=1 "$bin/python" -m unittest discover -s tests -p 'test_*.py' -v
