#!/usr/bin/env bash
# Checks the Python client (clients/python): the committed stubs equal a fresh generate.sh run,
# the client's unit tests against an in-process fake coordinator, and the example against a real
# local cluster (`dsa up`, skipped when build/bin, or $DSA_BIN_DIR, has no dsa). Runs with the
# pinned tools' venv (grpcio, grpcio-tools, protobuf; scripts/python_tools.sh); then builds the wheel out
# of tree into build/dist/ and imports it from a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)
cd clients/python
PYTHONDONTWRITEBYTECODE=1 "$bin/python" -m unittest discover -s tests -p 'test_*.py' -v
cd ../..
# The wheel, built out of tree (PEP 517, from a copy: setuptools writes build/ and an egg-info next
# to the sources it builds) into build/dist/, then installed into a fresh venv and imported there
# (its dependencies from the tools venv's site-packages: no download).
dist=build/dist
mkdir -p "$dist"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r clients/python "$work/src"
rm -f "$dist"/dsa_client-*.whl
"$bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$dist" "$work/src"
wheel=$(ls "$dist"/dsa_client-*.whl)
"$bin/python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
(cd "$work" && PYTHONPATH="$("$bin/python" -c 'import site; print(site.getsitepackages()[0])')" \
  "$work/venv/bin/python" -c 'import dsa_client, grpc_health; print("check_client: wheel", dsa_client.__file__)')
written=$(git status --porcelain --ignored clients/python | grep -E '^(\?\?|!!)' |
  grep -v '__pycache__' || true)
if [ -n "$written" ]; then
  echo "check_client: the build wrote into clients/python:" >&2
  echo "$written" >&2
  exit 1
fi
# CI's artifact: the wheel and its checksum, in build/dist/ (test.sh names them at its end).
(cd "$dist" && sha256sum dsa_client-*.whl > SHA256SUMS)
echo "check_client: $wheel ($(cut -d' ' -f1 "$dist/SHA256SUMS"))"
