#!/usr/bin/env bash
# Builds python/ (dsa_kernels, our kernels as a PyTorch extension) on the GPU host from this
# working tree, uncommitted edits included, when it is absent or older than any of its sources
# (indexer_service/cuda, python/csrc, python/setup.py); DSA_REBUILD=1 forces it. Says which it
# did; the build's output goes to LOG. Exit status: the build's (0 when up to date).
# usage (from anywhere): bash bench/peers/build_ours.sh [LOG] [TIMEOUT_S]
#   LOG default /dev/stdout; TIMEOUT_S default 240.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
log=${1:-/dev/stdout}
limit=${2:-240}
so=$(ls python/dsa_kernels/_C*.so 2>/dev/null | head -1)
newer=""
[ -n "$so" ] && newer=$(find indexer_service/cuda python/csrc python/setup.py -newer "$so" \
                        -type f | head -3)
if [ -n "$so" ] && [ -z "$newer" ] && [ "${DSA_REBUILD:-0}" != 1 ]; then
  echo "dsa_kernels already built and up to date: $so"
  exit 0
fi
echo "building dsa_kernels (${so:+sources newer than $so: $newer})"
SECONDS=0
(cd python && timeout "$limit" python3 setup.py build_ext --inplace --force) > "$log" 2>&1
rc=$?
echo "build dsa_kernels rc=$rc ${SECONDS}s"
exit $rc
