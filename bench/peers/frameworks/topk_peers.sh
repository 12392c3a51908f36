#!/usr/bin/env bash
# Times vLLM's, sgl-kernel's and SGLang's (JIT) DSA-indexer top-K kernels beside ours
# (dsa_kernels) on the GPU host: builds python/ (unless built), builds the peers in PEERS_DIR with
# torch.utils.cpp_extension (sm_90a, builds under /tmp), then runs
# bench/peers/topk_frameworks_bench.py on bell scores (rows 1/8/64 x slots 16K/64K/128K/1M) and
# all-equal scores (1 and 64 rows x 64K and 1M), K 2048. Writes into $OUT:
# topk_frameworks_bell.json, topk_frameworks_equal.json (report.py --extra takes them),
# topk_peers_t.txt (all output) and topk_peers_t.tgz (that plus build logs and the children's
# event logs).
# PEERS_DIR: the folder bench/peers/fetch_frameworks.sh assembled (vllm/, sgl_kernel/,
# sglang_jit/); the first argument, else $PEERS_DIR, else build/peers/frameworks (relative paths
# from the repo root).
# usage (GPU host): bash bench/peers/frameworks/topk_peers.sh [PEERS_DIR]
#                   (OUT defaults to /tmp/topk_peers_out)
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
PEERS=${1:-${PEERS_DIR:-build/peers/frameworks}}
if [ ! -f "$PEERS/vllm/bind.cpp" ] || [ ! -f "$PEERS/sglang_jit/bind.cpp" ]; then
  echo "topk_peers: $PEERS holds no assembled peers (bash bench/peers/fetch_frameworks.sh)" >&2
  exit 2
fi
PEERS=$(cd "$PEERS" && pwd)
OUT=${OUT:-/tmp/topk_peers_out}
mkdir -p "$OUT"
W=/tmp/topk_peers_t
B=/tmp/topk_peers_build
rm -rf "$W"
mkdir -p "$W" "$B"
export MAX_JOBS=16
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
BENCH=bench/peers/topk_frameworks_bench.py
SECONDS=0
pack() {
  cp -f "$W"/topk_frameworks_*.json "$OUT"/ 2>/dev/null
  cp -f "$W/topk_peers_t.txt" "$OUT"/ 2>/dev/null
  tar czf "$OUT/topk_peers_t.tgz" -C /tmp topk_peers_t 2>/dev/null
}
{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" || true
  nvcc --version 2>/dev/null | tail -1 || /usr/local/cuda/bin/nvcc --version | tail -1
  echo "peers: $PEERS"
  head -qn1 "$PEERS"/*/ORIGIN

  # 1. builds, in parallel: ours (bench/peers/build_ours.sh: unless up to date), the vllm, sgl
  # and sglang peer groups.
  git status --short -- indexer_service python | head -20
  pids=()
  bash bench/peers/build_ours.sh "$W/build_dsa.log" 240 &
  pids+=($!)
  for peer in "vllm vllm_cooperative" "sgl sgl_fast_topk_v2" "sglang sglang_topk_v2"; do
    read -r group method <<< "$peer"  # building one method of a group builds the group
    (timeout 240 python3 $BENCH --build-only --methods "$method" --peers-dir "$PEERS" \
       --build-dir "$B" --out "$W/unused.json" > "$W/build_$group.log" 2>&1;
     echo "build $group peer rc=$? ${SECONDS}s") &
    pids+=($!)
  done
  wait "${pids[@]}"
  echo "builds done ${SECONDS}s"
  grep -hiE "error|failed" "$W"/build_*.log | head -20

  # 2. the benches (a peer group a child process; a crash loses only the method in flight).
  # bell: every shape; all-equal (every score 1.0, the tie worst case): the shorter and the
  # longest rows at 1 and 64 rows. --budget-s stops a run in time, the shapes not reached null.
  timeout 230 python3 $BENCH --peers-dir "$PEERS" --build-dir "$B" --scores bell --stall-s 45 \
    --budget-s 200 --out "$W/topk_frameworks_bell.json"
  echo "bell rc=$? ${SECONDS}s"
  pack
  timeout 130 python3 $BENCH --peers-dir "$PEERS" --build-dir "$B" --scores equal --stall-s 45 \
    --budget-s 100 --shapes 1x65536,64x65536,1x1048576,64x1048576 \
    --out "$W/topk_frameworks_equal.json"
  echo "equal rc=$? ${SECONDS}s"
} 2>&1 | tee "$W/topk_peers_t.txt"
pack
echo "packed ${SECONDS}s: $(ls "$OUT")"
