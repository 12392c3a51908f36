#!/usr/bin/env bash
# Fetches the public peers that bench/peers/ compiles beside the indexer's kernels, pinned, into
# build/peers/ (ignored), and prints the CMake flag that builds bench_topk_peers:
#   - flashinfer-python 0.7.4: its header-only top-K (include/flashinfer/topk.cuh: TopKDispatch's
#     exact and fast radix modes; fast_topk_clusters_exact.cuh: the Hopper cluster top-K);
#   - apache-tvm-ffi 0.1.15.post2: the headers fast_topk_clusters_exact.cuh includes.
# Only the wheels' include trees are kept. Needs the package index once; later runs find them.
# usage: bash bench/peers/fetch_peers.sh   ->   -DDSA_PEERS_DIR=/abs/build/peers
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$PWD/build/peers
flashinfer="flashinfer-python==0.7.4"
tvm_ffi="apache-tvm-ffi==0.1.15.post2"
if [ ! -f "$out/include/flashinfer/topk.cuh" ] || [ ! -f "$out/include/tvm/ffi/error.h" ]; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$wheels" "$flashinfer" "$tvm_ffi" >&2
  rm -rf "$out/include" && mkdir -p "$out/include" "$wheels/x"
  python3 -m zipfile -e "$wheels"/flashinfer_python-*.whl "$wheels/x/fi" >&2
  python3 -m zipfile -e "$wheels"/apache_tvm_ffi-*.whl "$wheels/x/tvm" >&2
  cp -r "$wheels/x/fi/flashinfer/data/include/." "$out/include/"
  cp -r "$wheels/x/tvm/tvm_ffi/include/." "$out/include/"
  printf '%s\n%s\n' "$flashinfer" "$tvm_ffi" > "$out/VERSIONS"
  # The licenses travel with the headers.
  cp "$wheels"/x/fi/flashinfer_python-*.dist-info/licenses/LICENSE "$out/LICENSE.flashinfer" \
    2>/dev/null || true
fi
echo "-DDSA_PEERS_DIR=$out"
