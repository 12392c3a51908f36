#!/usr/bin/env bash
# On the GPU host: the sparse MLA decode's GPU test, compute-sanitizer memcheck on it (all but the
# 64-row grid cases), bench_gpu_attention at batch 1, 8 and 64 x 64K and 128K contexts, a
# split-count study and (unless DSA_ATTENTION_NCU=0) ncu counters of the wgmma kernel; logs and
# JSON go to OUT_DIR, a short table is printed last. DSA_ATTENTION_STUDIES=0 skips the split study
# and the parts left out. The bench also runs with DSA_ATTENTION_PANEL_WAIT=1 (step 7 of
# docs/history/attention_gpu_steps.md). The experiment switches (DSA_ATTENTION_PANEL_WAIT, DSA_ATTENTION_SKIP)
# are read only by bench_gpu_attention's own build of the kernel; the library and its test ignore
# them.
#
# usage (binaries in BIN_DIR: attention_cuda_sparse_mla_decode_test, bench_gpu_attention):
#   LD_LIBRARY_PATH=$PWD/.devrt:/usr/local/cuda/lib64 bash bench/run_gpu_attention_bench.sh BIN_DIR OUT_DIR
set -uo pipefail
bin=${1:?usage: run_gpu_attention_bench.sh BIN_DIR OUT_DIR}
out=${2:?usage: run_gpu_attention_bench.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/device.txt"
status=0
echo "=== attention_cuda_sparse_mla_decode_test" | tee "$out/tests.log"
timeout 200 "$bin/attention_cuda_sparse_mla_decode_test" >>"$out/tests.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|Failure|error" "$out/tests.log" | head -40
echo "=== memcheck" | tee "$out/memcheck.log"
timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$bin/attention_cuda_sparse_mla_decode_test" --gtest_brief=1 \
  --gtest_filter='-*Rows64K2048*:*Rows64K100*' >>"$out/memcheck.log" 2>&1 || status=1
tail -n 4 "$out/memcheck.log"
echo "=== bench_gpu_attention" | tee "$out/bench.txt"
timeout 200 "$bin/bench_gpu_attention" --out "$out/bench.json" >>"$out/bench.txt" 2>&1 || status=1
echo "=== DSA_ATTENTION_PANEL_WAIT=1" | tee -a "$out/bench.txt"
DSA_ATTENTION_PANEL_WAIT=1 timeout 120 "$bin/bench_gpu_attention" --mma wgmma \
  --cuda_cores_max_rows 0 --out "$out/bench_panel_wait.json" >>"$out/bench.txt" 2>&1 || status=1
DSA_ATTENTION_PANEL_WAIT=1 timeout 60 "$bin/bench_gpu_attention" --mma wgmma --shapes 1x65536 \
  --splits 1 --cuda_cores_max_rows 0 2>&1 | grep -E "^1x" >>"$out/bench.txt" || status=1
if [[ ${DSA_ATTENTION_STUDIES:-1} != 0 ]]; then
  echo "=== split study" | tee -a "$out/bench.txt"
  timeout 120 "$bin/bench_gpu_attention" --shapes 1x65536,8x65536,64x65536 --splits 1,2,4,8,16,32 \
    --mma wgmma --cuda_cores_max_rows 0 --out "$out/splits.json" >>"$out/bench.txt" 2>&1 || status=1
  # The wgmma kernel with one part left out at a time (DSA_ATTENTION_SKIP: 1 = S's wgmma, 2 = P V's,
  # 4 = the gathers past a split's first two tiles; wrong outputs, for the time differences).
  echo "=== parts left out (DSA_ATTENTION_SKIP)" | tee -a "$out/bench.txt"
  for skip in 0 1 2 4; do
    echo "--- DSA_ATTENTION_SKIP=$skip" >>"$out/bench.txt"
    DSA_ATTENTION_SKIP=$skip timeout 60 "$bin/bench_gpu_attention" --shapes 1x65536,64x65536 \
      --splits 1 --mma wgmma --cuda_cores_max_rows 0 --reps 10 2>&1 | grep -E "^(1|64)x" \
      >>"$out/bench.txt" || status=1
  done
fi
# Hardware counters of the wgmma kernel at 64 x 64K (DSA_ATTENTION_NCU=0 skips them).
if [[ ${DSA_ATTENTION_NCU:-1} != 0 ]]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 150 "$ncu" --clock-control none -k regex:Wgmma --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    "$bin/bench_gpu_attention" --shapes 64x65536 --mma wgmma --reps 3 --cuda_cores_max_rows 0 \
    >"$out/ncu.txt" 2>&1 || echo "ncu failed (see ncu.txt)"
  grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Executed Ipc|Eligible" "$out/ncu.txt" | head -30
fi
cat "$out/bench.txt"
exit $status
