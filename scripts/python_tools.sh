#!/usr/bin/env bash
# Creates (once) the virtual environment .venv-tools/ with the pinned Python tools of
# scripts/requirements-tools.txt and prints its bin/ folder. Reinstalls when the requirements
# change. Needs python3 with venv (Debian: python3-venv, installed by scripts/bootstrap.sh).
# Usage: bin=$(bash scripts/python_tools.sh) && "$bin/check-jsonschema" ...
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DSA_TOOLS_VENV:-$PWD/.venv-tools}
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s scripts/requirements-tools.txt "$stamp"; then
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r scripts/requirements-tools.txt >&2
  cp scripts/requirements-tools.txt "$stamp"
fi
echo "$venv/bin"
