#!/usr/bin/env bash
# Prepares one folder for the GPU host (which can neither install nor build): builds, here, with
# CUDA for sm_90a, every GPU test, the GPU benchmarks (bench_topk_peers with the peers' headers of
# bench/peers/fetch_peers.sh) and the four binaries of the main job, and
# copies them with the PyTorch peer and the Mooncake trace into DIR; packs the shared libraries
# they need into .devrt/. Both are ignored by git and travel with a device run.
#
# usage: bash scripts/gpu_carry.sh [DIR]        (DIR defaults to carry-gpu; build in build-cuda)
# then, on the GPU host (the device tool's `carry`: ["DIR", ".devrt"]):
#   export LD_LIBRARY_PATH=$PWD/.devrt:/usr/local/cuda/lib64
#   bash bench/run_gpu_bench.sh DIR $OUT tests      # or sanitize, bench, all
#   DSA_TWO_GPU_ARCHIVE=$OUT/two_gpu.tgz bash bench/run_two_gpu.sh DIR /tmp/two_gpu  # two GPUs
#   DSA_PREBUILT_BIN=DIR DSA_INDEXER_DEVICE=cuda DSA_REPLAY_TRACE=DIR/mooncake_conversation_trace.jsonl \
#     DSA_EVAL_OUT=$OUT bash scripts/throughput_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-carry-gpu}
build=${DSA_BUILD_DIR:-build-cuda}
tests="device_info key_append scan topk spin_predict spin_update select scoring_device"
benches="bench_gpu_indexer bench_gpu_select bench_gpu_spin bench_gpu_topk bench_engine_decode_step
bench_remote_select_rtt bench_topk_peers"
# The public peers compiled beside our kernels (bench/peers/): their headers, fetched once.
peers_flag=$(bash bench/peers/fetch_peers.sh)
servers="dsa dsa-indexer dsa-attention dsa-coordinator"
targets="$servers $benches dsa_layer_standin_module"
for t in $tests; do targets="$targets indexer_cuda_${t}_test"; done
DSA_BUILD_DIR=$build DSA_CMAKE_ARGS="-DDSA_ENABLE_CUDA=ON $peers_flag ${DSA_CMAKE_ARGS:-}" \
  DSA_BUILD_TARGETS=$targets bash scripts/build.sh
rm -rf "$dir"
mkdir -p "$dir"
for t in $targets; do [ "$t" = dsa_layer_standin_module ] || cp "$build/bin/$t" "$dir/"; done
cp "$build/bin/libdsa_layer_standin.so" "$dir/"  # dsa-attention --layer-standin
cp bench/torch_peer_indexer.py data/traces/mooncake_conversation_trace.jsonl "$dir/"
bash scripts/pack_runtime.sh .devrt "$dir"/dsa* "$dir"/indexer_cuda_* "$dir"/bench_*
for ignored in "/$dir/" "/.devrt/"; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >>.git/info/exclude
done
echo "gpu_carry: $(du -sh "$dir" | cut -f1) in $dir, $(du -sh .devrt | cut -f1) in .devrt (64 MiB a call at most)"
