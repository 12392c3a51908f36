#!/usr/bin/env bash
# Assembles the sources of the serving frameworks' DSA top-K peers that
# bench/peers/topk_frameworks_bench.py builds, pinned and unchanged, with their licenses, into DEST
# (default build/peers/frameworks, ignored), beside our bindings (bench/peers/frameworks/):
#   vllm/        vllm==0.34.0, the source distribution (hash-checked): csrc/ top-K files, LICENSE
#   sglang_jit/  sglang==0.5.23, the cp311 manylinux_2_34 x86_64 wheel (hash-checked): the JIT
#                top-k v2 and occupancy-probe sources of sglang/kernels/jit, LICENSE;
#                tvm_ffi/: apache-tvm-ffi==0.1.11, the cp311 manylinux_2_28 x86_64 wheel
#                (hash-checked): include/, lib/libtvm_ffi.so, LICENSE, NOTICE
#   sgl_kernel/  sgl-kernel's csrc/elementwise/topk.cu (sglang commit 06c48ca8): in no package of
#                the index (sgl-kernel and sglang-kernel publish wheels only, sglang has no sdist
#                of 0.5.23), so it is taken from SGL_TOPK_CU=FILE, checked by its sha256; LICENSE
#                from the sglang wheel (the same Apache-2.0 text as sgl-kernel's). Without
#                SGL_TOPK_CU, sgl_kernel/ has no topk.cu and the bench reports that group's
#                sources missing.
# Each peer folder gets an ORIGIN file (its first line goes into the bench's JSON). Our binding
# files are copied in on every run; the downloads (about 92 MB, --no-deps) only when DEST/VERSIONS
# is absent or names other pins. Needs the package index on that run; the GPU host needs only DEST.
# usage: [SGL_TOPK_CU=path/to/topk.cu] bash bench/peers/fetch_frameworks.sh [DEST]
#        then, on the GPU host: bash bench/peers/frameworks/topk_peers.sh DEST
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
ours=$repo/bench/peers/frameworks
dest=${1:-build/peers/frameworks}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

vllm_pin="vllm==0.34.0 --hash=sha256:fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
sglang_pin="sglang==0.5.23 --hash=sha256:00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
tvm_pin="apache-tvm-ffi==0.1.11 --hash=sha256:87f84e7c2393fadac340fd179a631a697effe54d7317b2543e0930452a0a673d"
topk_cu_sha256=ac471c6a10050b6cf68dbe9aa052f05b038ae0f75e6a291bbf8917e1715f3894
versions=$(printf '%s\n' "$vllm_pin" "$sglang_pin" "$tvm_pin")

vllm_files="sampler.cu topk.cu cooperative_topk.cu cooperative_topk.cuh cooperative_topk_overflow.cuh
  persistent_topk.cuh persistent_topk_overflow.cuh sampled_topk.cuh topk_histogram_4096.cuh
  topk_histogram_4096_overflow.cuh torch_utils.h dispatch_utils.h ops.h core/cuda_compat.h"
sglang_files="csrc/deepseek_v4/topk_v2.cuh csrc/occupancy/cluster_probe.cuh
  include/sgl_kernel/utils.h include/sgl_kernel/source_location.h include/sgl_kernel/utils.cuh
  include/sgl_kernel/tensor.h include/sgl_kernel/runtime.cuh include/sgl_kernel/bits.h
  include/sgl_kernel/type.cuh include/sgl_kernel/vec.cuh include/sgl_kernel/warp.cuh
  include/sgl_kernel/math.cuh include/sgl_kernel/tile.cuh
  include/sgl_kernel/deepseek_v4/topk_impl.cuh"

pip_download() {  # pip_download DIR REQUIREMENT [pip options...]
  local dir=$1 req=$2
  shift 2
  printf '%s\n' "$req" > "$dir/req.txt"
  python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
    -d "$dir/dl" -r "$dir/req.txt" "$@" >&2
}

tmp=""
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT

fetch_upstream() {
  tmp=$(mktemp -d)
  mkdir -p "$tmp/dl" "$tmp/x" "$tmp/pip-tmp"
  local wheel_opts=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311)
  echo "downloading sglang 0.5.23 and apache-tvm-ffi 0.1.11 wheels" >&2
  pip_download "$tmp" "$sglang_pin" "${wheel_opts[@]}" --platform manylinux_2_34_x86_64
  pip_download "$tmp" "$tvm_pin" "${wheel_opts[@]}" --platform manylinux_2_28_x86_64
  # vLLM's sdist: pip checks its hash, unpacks it and then prepares its metadata, which runs
  # vLLM's setup.py and needs torch (an isolated build would install torch and CUDA wheels). So
  # the build is not isolated and --no-clean keeps the unpacked tree: the metadata step fails
  # without torch, and the tree under pip's temporary folder is the sdist's content. Where it
  # succeeds, the sdist itself lands in dl/ and is unpacked here.
  echo "downloading the vllm 0.34.0 sdist (its metadata step may fail: only its files are used)" >&2
  TMPDIR=$tmp/pip-tmp VLLM_TARGET_DEVICE=empty pip_download "$tmp" "$vllm_pin" \
    --no-binary :all: --no-build-isolation --no-clean 2> "$tmp/vllm_pip.log" || true
  local vsrc
  if [ -f "$tmp/dl/vllm-0.34.0.tar.gz" ]; then
    tar -xzf "$tmp/dl/vllm-0.34.0.tar.gz" -C "$tmp/x"
    vsrc=$tmp/x/vllm-0.34.0
  else
    vsrc=$(ls -d "$tmp"/pip-tmp/pip-download-*/vllm* 2>/dev/null | head -1 || true)
  fi
  if [ -z "$vsrc" ] || ! grep -qx "Version: 0.34.0" "$vsrc/PKG-INFO" 2>/dev/null; then
    tail -20 "$tmp/vllm_pip.log" >&2
    echo "fetch_frameworks: the vllm 0.34.0 sdist could not be downloaded or unpacked" >&2
    return 1
  fi
  python3 -m zipfile -e "$tmp"/dl/sglang-0.5.23-*.whl "$tmp/x/sglang"
  python3 -m zipfile -e "$tmp"/dl/apache_tvm_ffi-0.1.11-*.whl "$tmp/x/tvm"

  rm -rf "$dest/vllm" "$dest/sglang_jit" "$dest/sgl_kernel" "$dest/VERSIONS"
  local f
  for f in $vllm_files; do install -D -m 644 "$vsrc/csrc/$f" "$dest/vllm/csrc/$f"; done
  install -m 644 "$vsrc/LICENSE" "$dest/vllm/LICENSE"
  local jit=$tmp/x/sglang/sglang/kernels/jit
  for f in $sglang_files; do install -D -m 644 "$jit/$f" "$dest/sglang_jit/$f"; done
  install -m 644 "$tmp"/x/sglang/sglang-0.5.23.dist-info/licenses/LICENSE "$dest/sglang_jit/LICENSE"
  mkdir -p "$dest/sglang_jit/tvm_ffi/lib" "$dest/sgl_kernel"
  cp -r "$tmp/x/tvm/tvm_ffi/include" "$dest/sglang_jit/tvm_ffi/include"
  install -m 644 "$tmp/x/tvm/tvm_ffi/lib/libtvm_ffi.so" "$dest/sglang_jit/tvm_ffi/lib/"
  install -m 644 "$tmp"/x/tvm/apache_tvm_ffi-0.1.11.dist-info/licenses/{LICENSE,NOTICE} \
    "$dest/sglang_jit/tvm_ffi/"
  install -m 644 "$dest/sglang_jit/LICENSE" "$dest/sgl_kernel/LICENSE"
  printf '%s\n' "$versions" > "$dest/VERSIONS"
}

if [ "$(cat "$dest/VERSIONS" 2>/dev/null)" != "$versions" ] ||
   [ ! -f "$dest/vllm/csrc/topk.cu" ] || [ ! -f "$dest/sglang_jit/tvm_ffi/lib/libtvm_ffi.so" ]; then
  fetch_upstream
else
  echo "upstream files already in $dest (VERSIONS matches)" >&2
fi

# sgl-kernel's topk.cu, from a file the caller names (see above), only if its hash matches.
if [ -n "${SGL_TOPK_CU:-}" ]; then
  if [ "$(sha256sum < "$SGL_TOPK_CU" | cut -d' ' -f1)" != "$topk_cu_sha256" ]; then
    echo "fetch_frameworks: $SGL_TOPK_CU is not sgl-kernel's topk.cu at sglang 06c48ca8" \
         "(sha256 $topk_cu_sha256)" >&2
    exit 1
  fi
  install -m 644 "$SGL_TOPK_CU" "$dest/sgl_kernel/topk.cu"
elif [ ! -f "$dest/sgl_kernel/topk.cu" ]; then
  echo "fetch_frameworks: no SGL_TOPK_CU: sgl_kernel/topk.cu missing (the sgl group won't build)" >&2
fi

# Our bindings, and each peer's ORIGIN.
cp "$ours"/vllm/bind.cpp "$dest/vllm/"
cp "$ours"/sgl_kernel/bind.cpp "$dest/sgl_kernel/"
cp "$ours"/sglang_jit/{entry.cu,probe_entry.cu,bind.cpp,probe_bind.cpp,tensor_desc.h} \
  "$dest/sglang_jit/"
cat > "$dest/vllm/ORIGIN" <<'EOF'
vLLM 0.34.0 (source distribution vllm-0.34.0.tar.gz, vllm/_version.py commit g62d4bc3c7), csrc/ files unchanged
Fetched by bench/peers/fetch_frameworks.sh (pip download --no-deps --no-binary :all:, sha256
fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113). Files: csrc/{sampler.cu, topk.cu,
cooperative_topk.cu, cooperative_topk.cuh, cooperative_topk_overflow.cuh, persistent_topk.cuh,
persistent_topk_overflow.cuh, sampled_topk.cuh, topk_histogram_4096.cuh,
topk_histogram_4096_overflow.cuh, torch_utils.h, dispatch_utils.h, ops.h, core/cuda_compat.h},
LICENSE (Apache-2.0). bind.cpp is ours (bench/peers/frameworks/vllm/).
EOF
cat > "$dest/sgl_kernel/ORIGIN" <<'EOF'
sgl-kernel (sgl-project/sglang) sgl-kernel/csrc/elementwise/topk.cu at commit 06c48ca8da0b2c8aac15df74a768e6a012444064, unchanged
No package of the index ships it (sgl-kernel and sglang-kernel publish wheels only); given to
bench/peers/fetch_frameworks.sh as SGL_TOPK_CU and checked by sha256
ac471c6a10050b6cf68dbe9aa052f05b038ae0f75e6a291bbf8917e1715f3894 (19,223 bytes). Its host entry
points, TORCH_CHECK messages and op schemas match the strings of the released sglang-kernel 0.4.10
wheel (sgl_kernel/sm90/common_ops.abi3.so) and its sgl_kernel/top_k.py wrappers. LICENSE
(Apache-2.0) from the sglang 0.5.23 wheel (the same text as sglang-kernel 0.4.10's). bind.cpp is
ours (bench/peers/frameworks/sgl_kernel/).
EOF
cat > "$dest/sglang_jit/ORIGIN" <<'EOF'
SGLang 0.5.23 (the sglang wheel; its package ships the JIT kernel sources), sglang/kernels/jit files unchanged
Fetched by bench/peers/fetch_frameworks.sh (pip download --no-deps, the cp311 manylinux_2_34
x86_64 wheel, sha256 00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937). Files:
csrc/deepseek_v4/topk_v2.cuh, csrc/occupancy/cluster_probe.cuh, include/sgl_kernel/{utils.h,
source_location.h, utils.cuh, tensor.h, runtime.cuh, bits.h, type.cuh, vec.cuh, warp.cuh, math.cuh,
tile.cuh, deepseek_v4/topk_impl.cuh}; LICENSE (Apache-2.0) from the wheel. tvm_ffi/: include/ and
lib/libtvm_ffi.so of apache-tvm-ffi 0.1.11 (the version sglang 0.5.23 requires; the cp311
manylinux_2_28 x86_64 wheel, sha256 87f84e7c2393fadac340fd179a631a697effe54d7317b2543e0930452a0a673d),
its LICENSE and NOTICE. entry.cu, probe_entry.cu, bind.cpp, probe_bind.cpp, tensor_desc.h are ours
(bench/peers/frameworks/sglang_jit/).
EOF
echo "$dest"
