#!/usr/bin/env bash
# Generates the Python messages and gRPC stubs of proto/dsa/*/v1 into dsa_client/proto/ (or into
# the folder given as $1, which the stub test uses to compare with the committed files), with the
# pinned grpcio-tools of the tools' venv (scripts/python_tools.sh). protoc writes absolute imports
# (`from dsa.common.v1 import tensor_pb2`); they are rewritten to dsa_client.proto.dsa... so the
# stubs live inside the dsa_client package instead of a top-level `dsa` package.
set -euo pipefail
cd "$(dirname "$0")"
repo_root=$(cd ../.. && pwd)
out=${1:-dsa_client/proto}
bin=$(bash "$repo_root/scripts/python_tools.sh")

mkdir -p "$out"
out=$(cd "$out" && pwd)
find "$out" -name '*_pb2*.py*' -delete
mapfile -t protos < <(cd "$repo_root/proto" && find dsa -name '*.proto' | LC_ALL=C sort)
(cd "$repo_root/proto" &&
  "$bin/python" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" "${protos[@]}")

# Packages: an __init__.py in every folder, and the imports pointed inside dsa_client.
find "$out" -type d -exec sh -c 'for d; do [ -f "$d/__init__.py" ] || : >"$d/__init__.py"; done' \
  _ {} +
find "$out" -name '*_pb2*.py*' -exec sed -i \
  -e 's/^from dsa\.\([a-z0-9_.]*\) import /from dsa_client.proto.dsa.\1 import /' \
  -e 's/^import dsa\.\([a-z0-9_.]*\)_pb2 as /import dsa_client.proto.dsa.\1_pb2 as /' {} +
echo "generate: ${#protos[@]} protos into $out"
