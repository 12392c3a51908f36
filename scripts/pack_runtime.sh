#!/usr/bin/env bash
# Gathers the shared libraries that binaries built here load, for a GPU host that has CUDA, NCCL and
# the C runtime but not this machine's gRPC, Abseil or prometheus-cpp: every library ldd resolves,
# except those the host provides (the C and C++ runtimes, CUDA's and NCCL's, the driver's).
#
# usage: bash scripts/pack_runtime.sh OUT_DIR BINARY...
# on the GPU host: LD_LIBRARY_PATH=$PWD/OUT_DIR:/usr/local/cuda/lib64 ./BINARY
set -euo pipefail
out=${1:?usage: pack_runtime.sh OUT_DIR BINARY...}
shift
[ $# -gt 0 ] || { echo "usage: pack_runtime.sh OUT_DIR BINARY..." >&2; exit 2; }
mkdir -p "$out"
host_provided='/(ld-linux[^/]*|lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+|cuda|cudart|cublas[^/]*|cudnn[^/]*|cufft[^/]*|curand|cusparse|cusolver[^/]*|nvrtc[^/]*|nvJitLink|nccl|nvidia[^/]*))\.so'
for binary in "$@"; do
  [ -x "$binary" ] || continue
  # (grep finds nothing for a binary that needs only what the host has)
  ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | { grep -v -E "$host_provided" || true; } |
    while read -r library; do
      [ -e "$out/$(basename "$library")" ] || cp -L "$library" "$out/"
    done
done
echo "pack_runtime: $(find "$out" -maxdepth 1 -type f | wc -l) libraries, $(du -sh "$out" | cut -f1), in $out"
