#!/usr/bin/env bash
# Runs bench/peers/ on the GPU host: bench_topk_peers on every shape (rows 1 / 8 / 64 x slots
# 16K / 64K / 128K / 1M) with bell-shaped scores, then the all-equal worst case at two shapes, the
# device's state beside them. Writes OUT/topk_peers.txt (the tables) and OUT/topk_peers_*.json
# (bench/peers/report.py turns them into docs/results/topk_peers_<device>.md).
# usage: bash bench/peers/run_peers.sh BIN_DIR OUT
set -euo pipefail
bin=$1
out=$2
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  "$bin/bench_topk_peers" --json "$out/topk_peers_bell.json"
  "$bin/bench_topk_peers" --scores equal --shapes 1x65536,64x65536 \
    --json "$out/topk_peers_equal.json"
} 2>&1 | tee "$out/topk_peers.txt"
