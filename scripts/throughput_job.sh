#!/usr/bin/env bash
# The throughput run on the synthetic pattern model (the real model's replay is
# scripts/main_job.sh): install what is missing, build, then
# 1. replay the Mooncake conversation trace (capped: see replay_args) through a local cluster of
#    dsa-indexer, dsa-attention and dsa-coordinator running the pattern model at the production
#    indexer shape (`dsa replay --local --model pattern`), writing docs/results/replay_mooncake.json
#    and .md; the job fails if any request fails;
# 2. with DSA_MAIN_JOB_EVAL=1, also the SPIN quality evaluation (`dsa eval`, 2-4 minutes on 2
#    cores) on the pattern model, writing eval.json, eval.md and the plot eval_miss_vs_sparsity.png
#    in the folder above.
# Results go to $DSA_EVAL_OUT (default docs/results/). Extra arguments go to `dsa eval` (not
# --json/--markdown); $DSA_REPLAY_ARGS replaces the replay caps below; $DSA_BUILD_DIR is the build
# folder (default build/).
# The same job on the GPU host (which can neither install nor build): DSA_INDEXER_DEVICE=cuda runs
# the indexers with --device cuda and writes replay_mooncake_cuda.{json,md}; DSA_PREBUILT_BIN=DIR
# takes the binaries from DIR and skips the bootstrap and the build. $DSA_REPLAY_EXTRA_ARGS are
# added to the replay's flags (e.g. the two-GPU run's --transport nccl and GPU placement,
# bench/run_two_gpu.sh) and $DSA_REPLAY_NAME replaces the reports' name.
set -euo pipefail
# A relative DSA_PREBUILT_BIN is relative to where the job was started.
if [ -n "${DSA_PREBUILT_BIN:-}" ]; then DSA_PREBUILT_BIN=$(realpath "$DSA_PREBUILT_BIN"); fi
cd "$(dirname "$0")/.."
out=${DSA_EVAL_OUT:-docs/results}
bin=${DSA_BUILD_DIR:-build}/bin
plot=${DSA_EVAL_PLOT:-$(dirname "$out")/eval_miss_vs_sparsity.png}
trace=${DSA_REPLAY_TRACE:-data/traces/mooncake_conversation_trace.jsonl}
# 250 requests, contexts capped at 8192 tokens and outputs at 32, sent as fast as 16 concurrent
# streams allow, draft length 2; the production indexer shape (H=64, D=128, K=2048), rho=0.4; 10%
# of pruned selects audited for the miss rate. About 2.5 minutes on 2 cores.
read -r -a replay_args <<<"${DSA_REPLAY_ARGS:---limit 250 --max-context 8192 --max-output 32 \
--time-scale 0 --max-in-flight 16 --draft-length 2 --capacity-blocks 16384 --audit-fraction 0.1}"
device=${DSA_INDEXER_DEVICE:-cpu}
# Not passed on: dsa-attention reads DSA_INDEXER_DEVICE as its --indexer-device (the co-located
# indexer's, refused without --transport inprocess), so the workers of the replay would fail.
unset DSA_INDEXER_DEVICE
case $device in
  cpu) name=replay_mooncake ;;
  cuda) name=replay_mooncake_cuda ;;
  *) echo "throughput job: DSA_INDEXER_DEVICE must be cpu or cuda, not '$device'" >&2; exit 2 ;;
esac
name=${DSA_REPLAY_NAME:-$name}
read -r -a extra_args <<<"${DSA_REPLAY_EXTRA_ARGS:-}"
if [ -n "${DSA_PREBUILT_BIN:-}" ]; then
  bin=$DSA_PREBUILT_BIN
else
  bash scripts/bootstrap.sh
  # Only what the job runs: the dsa tool and the three servers (the tests build with
  # scripts/test.sh).
  DSA_BUILD_TARGETS="dsa dsa-indexer dsa-attention dsa-coordinator" bash scripts/build.sh
fi
mkdir -p "$out"

if [ -f "$trace" ]; then
  start=$(date +%s)
  "$bin/dsa" replay --local --model pattern --indexer-device "$device" --trace "$trace" \
    "${replay_args[@]}" \
    ${extra_args[@]+"${extra_args[@]}"} \
    --json "$out/$name.json" --markdown "$out/$name.md"
  echo "throughput job: wrote $out/$name.json and $out/$name.md" \
    "(replay $(($(date +%s) - start)) s)"
else
  echo "throughput job: no trace at $trace: the repository carries it in data/traces/; set" \
    "DSA_REPLAY_TRACE to a Mooncake .jsonl or Azure .csv trace to use another" >&2
  exit 1
fi

if [ "${DSA_MAIN_JOB_EVAL:-0}" != 0 ]; then
  "$bin/dsa" eval --json "$out/eval.json" --markdown "$out/eval.md" "$@"
  if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
    /usr/bin/python3 tools/plot_eval.py "$out/eval.json" "$plot"
    echo "throughput job: wrote $out/eval.json, $out/eval.md and $plot"
  else
    echo "throughput job: wrote $out/eval.json and $out/eval.md (no matplotlib for the plot)" >&2
  fi
fi
