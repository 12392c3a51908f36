#!/usr/bin/env bash
# Builds DeepGEMM (a source tarball: deepseek-ai/DeepGEMM 54e2261 with its cutlass and fmt
# headers, as bench/peers/fetch_deepgemm.sh assembles it) and our python/ module on the GPU host,
# calls DeepGEMM's metadata alone in a process (its native stack printed on a crash, through
# segv_backtrace.c), then runs bench/peers/deepgemm_bench.py (DeepGEMM's fp8_paged_mqa_logits
# beside our scan, one process a shape). Writes $OUT/deepgemm_results.tar.gz: the bench JSON, this
# run's log, both build logs and the lone call's log.
#
# usage (GPU host, repo root):
#   bash bench/peers/deepgemm.sh [TARBALL] [extra deepgemm_bench.py args]
# TARBALL: a first argument not starting with "-", else $DG_TARBALL, else
#   build/peers/deepgemm-src.tar.gz (fetch_deepgemm.sh's default).
# env: OUT (default /tmp/dgp-out), PY (default python3), MAX_JOBS (default 16),
#      DEADLINE_S (default 540: the bench gets what is left of it after the builds, at most
#      BENCH_BUDGET_S, default 300; no shape starts later and a running one is cut there).
set -uo pipefail

REPO=$(pwd)
TARBALL=${DG_TARBALL:-$REPO/build/peers/deepgemm-src.tar.gz}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then TARBALL=$1; shift; fi
if [ ! -f "$TARBALL" ]; then
  echo "deepgemm.sh: no DeepGEMM source tarball at $TARBALL (bench/peers/fetch_deepgemm.sh)" >&2
  exit 2
fi
TARBALL=$(cd "$(dirname "$TARBALL")" && pwd)/$(basename "$TARBALL")
W=/tmp/dgp
OUT=${OUT:-/tmp/dgp-out}
PY=${PY:-python3}
export MAX_JOBS=${MAX_JOBS:-16}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-300}
DEADLINE_S=${DEADLINE_S:-540}
DG_COMMIT=54e22612409371d6364144b69086735beb54e98b
T0=$(date +%s)

log() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

main() {
  log "start in $REPO; OUT=$OUT; DeepGEMM from $TARBALL"
  sha256sum "$TARBALL" || true
  log "environment"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv || true
  nvcc --version | tail -2 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch.compiled_with_cxx11_abi())' || true
  echo "CC=${CC:-} CXX=${CXX:-} gcc=$(command -v gcc || echo none) g++=$(command -v g++ || echo none)"
  gcc --version 2>/dev/null | head -1 || true

  # DeepGEMM's JIT runs $CUDA_HOME/bin/nvcc with -I deep_gemm/include (deep_gemm/, cute/, cutlass/)
  # and caches cubins under DG_JIT_CACHE_DIR. The host compiler nvcc uses: the one torch's build
  # uses (CC), when set.
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export DG_JIT_CACHE_DIR="$W/jit-cache"
  export DG_JIT_PRINT_COMPILER_COMMAND=1
  if [ -n "${CC:-}" ] && [ -z "${NVCC_CCBIN:-}" ]; then export NVCC_CCBIN="$CC"; fi
  echo "CUDA_HOME=$CUDA_HOME NVCC_CCBIN=${NVCC_CCBIN:-} DG_JIT_CACHE_DIR=$DG_JIT_CACHE_DIR"

  log "unpack DeepGEMM"
  timeout 60 tar -xzf "$TARBALL" -C "$W" || { log "unpack failed"; return 1; }
  local DG="$W/DeepGEMM"
  cat "$DG/CARRY_SOURCES.txt"
  ln -sfn ../../third-party/cutlass/include/cute "$DG/deep_gemm/include/cute"
  ln -sfn ../../third-party/cutlass/include/cutlass "$DG/deep_gemm/include/cutlass"
  ls -l "$DG/deep_gemm/include"
  # The extension exactly as DeepGEMM's setup.py builds it (get_ext_modules), without the rest
  # of that setup.py (it imports wheel and packaging, runs git, and packages the includes).
  cat > "$DG/carry_build_ext.py" <<'PYEOF'
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

root = os.path.dirname(os.path.abspath(__file__))  # absolute: ninja compiles from build/
cxx_flags = ['-std=c++17', '-O3', '-fPIC', '-Wno-psabi', '-Wno-deprecated-declarations',
             f'-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}']
setup(name='deep_gemm',
      ext_modules=[CUDAExtension(name='deep_gemm._C', sources=[f'{root}/csrc/python_api.cpp'],
                                 include_dirs=[f'{CUDA_HOME}/include', f'{CUDA_HOME}/include/cccl',
                                               f'{root}/deep_gemm/include',
                                               f'{root}/third-party/cutlass/include',
                                               f'{root}/third-party/fmt/include'],
                                 libraries=['cudart', 'nvrtc'],
                                 library_dirs=[f'{CUDA_HOME}/lib64'],
                                 extra_compile_args=cxx_flags)],
      cmdclass={'build_ext': BuildExtension})
PYEOF

  log "build DeepGEMM (background) and dsa_kernels (foreground), MAX_JOBS=$MAX_JOBS"
  ( cd "$DG" && timeout 240 "$PY" carry_build_ext.py build_ext --inplace > "$W/deepgemm_build.log" 2>&1
    echo $? > "$W/deepgemm_build.rc" ) &
  local dg_pid=$!
  ( cd "$REPO/python" && timeout 240 "$PY" setup.py build_ext --inplace ) > "$W/dsa_build.log" 2>&1
  local dsa_rc=$?
  log "dsa_kernels build rc=$dsa_rc"; tail -3 "$W/dsa_build.log"
  wait "$dg_pid"
  log "DeepGEMM build rc=$(cat "$W/deepgemm_build.rc" 2>/dev/null || echo '?')"; tail -3 "$W/deepgemm_build.log"
  ls -l "$DG"/deep_gemm/_C*.so 2>/dev/null || log "no DeepGEMM extension built"

  log "import checks"
  ( cd "$DG" && timeout 60 "$PY" -c 'import deep_gemm; print("deep_gemm", deep_gemm.__version__, deep_gemm.__file__, "sms", deep_gemm.get_num_sms(), "pdl", deep_gemm.get_pdl())' ) || log "deep_gemm import failed (rc=$?)"
  ( cd "$REPO/python" && timeout 30 "$PY" -c 'import dsa_kernels as dk; print("dsa_kernels", dk.__file__)' ) || log "dsa_kernels import failed (rc=$?)"

  # DeepGEMM alone in a process (no dsa_kernels loaded), its metadata call at one 64K context,
  # with the native stack printed if it crashes (segv_backtrace.c: the host has no gdb).
  log "DeepGEMM alone: get_paged_mqa_logits_metadata, native stack on a crash"
  gcc -shared -fPIC -O1 -o "$W/libsegv_backtrace.so" "$REPO/bench/peers/segv_backtrace.c" ||
    log "segv_backtrace build failed"
  ( cd "$DG" && LD_PRELOAD="$W/libsegv_backtrace.so" timeout 120 "$PY" -X faulthandler -c '
import torch, deep_gemm
ctx = torch.full((1, 1), 65536, dtype=torch.int32, device="cuda")
meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, deep_gemm.get_num_sms())
torch.cuda.synchronize()
print("metadata ok", tuple(meta.shape))' ) > "$W/deepgemm_alone.log" 2>&1
  log "DeepGEMM alone rc=$?"; tail -40 "$W/deepgemm_alone.log"

  local left=$(( DEADLINE_S - ($(date +%s) - T0) - 20 ))
  local budget=$(( left < BENCH_BUDGET_S ? left : BENCH_BUDGET_S ))
  if [ "$budget" -lt 30 ]; then budget=30; fi
  log "bench (budget $budget s)"
  timeout $(( budget + 30 )) "$PY" "$REPO/bench/peers/deepgemm_bench.py" \
    --deepgemm-dir "$DG" --dsa-dir "$REPO/python" --out "$W/deepgemm_bench.json" \
    --deepgemm-commit "$DG_COMMIT" --child-timeout-s 180 --time-budget-s "$budget" "$@"
  log "bench rc=$?"
  ls "$DG_JIT_CACHE_DIR/cache" 2>/dev/null | head -20 || true
}

rm -rf "$W"; mkdir -p "$W" "$OUT"
main "$@" 2>&1 | tee "$W/deepgemm_run.log"
log "pack results" | tee -a "$W/deepgemm_run.log"
( cd "$W" && tar -czf "$OUT/deepgemm_results.tar.gz" \
    $(ls deepgemm_bench.json deepgemm_run.log deepgemm_build.log dsa_build.log \
         deepgemm_alone.log 2>/dev/null) )
ls -l "$OUT"
log "done"
