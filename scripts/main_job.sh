#!/usr/bin/env bash
# The main job: serve the real model. Installs what is missing, sets up SmolLM2-135M's files
# (scripts/model_setup.sh: the backbone, tokenizer and held-out text; its trained lightning
# indexers are in data/models/), builds the dsa tool and the three servers, then replays the
# Mooncake conversation trace through a local cluster running the real model on the CPU
# (`dsa replay --local --model smollm2`: dsa-indexer at the model's indexer shape H 16, D 64,
# dsa-attention --model smollm2, the coordinator at top-K 512; 64-slot blocks). Each request's
# context is real text, 512-token slices of the held-out split chosen by the trace's hash ids, so
# requests that share hash ids share tokens and the coordinator's content hashing reproduces the
# trace's prefix sharing; greedy decoding with the coordinator's n-gram drafts. Writes
# docs/results/replay_mooncake_smollm2.json and .md (the caps, tokens/s, TTFT, inter-token latency,
# realized block sparsity, draft acceptance, finish reasons, sample outputs), prints the summary
# and the sample outputs' text (decoded with the model's tokenizer), and fails if any request
# fails. The pattern model's throughput run is scripts/throughput_job.sh.
#
# $DSA_REPLAY_ARGS replaces the caps below; $DSA_REPLAY_TRACE the trace; $DSA_EVAL_OUT the results
# folder (default docs/results/); $DSA_REPLAY_NAME the reports' name; $DSA_BUILD_DIR the build
# folder (default build/); DSA_PREBUILT_BIN=DIR takes the binaries from DIR and skips the bootstrap
# and the build.
set -euo pipefail
if [ -n "${DSA_PREBUILT_BIN:-}" ]; then DSA_PREBUILT_BIN=$(realpath "$DSA_PREBUILT_BIN"); fi
cd "$(dirname "$0")/.."
job_start=$SECONDS
out=${DSA_EVAL_OUT:-docs/results}
bin=${DSA_BUILD_DIR:-build}/bin
trace=${DSA_REPLAY_TRACE:-data/traces/mooncake_conversation_trace.jsonl}
name=${DSA_REPLAY_NAME:-replay_mooncake_smollm2}
# The first 60 requests, contexts capped at 2,048 tokens and outputs at 32, sent as fast as 8
# concurrent streams allow, draft length 2, 10% of pruned selects audited for the miss rate; the
# index-key cache sized for the contexts in flight plus the retained prefix donors. The replay is
# bound by the prefills (116k context tokens on the CPU): 2.5-6 minutes on 2 cores, the longer
# when the cores are shared.
read -r -a replay_args <<<"${DSA_REPLAY_ARGS:---limit 60 --max-context 2048 --max-output 32 \
--time-scale 0 --max-in-flight 8 --draft-length 2 --capacity-blocks 16384 --audit-fraction 0.1}"
if [ "${DSA_INDEXER_DEVICE:-cpu}" != cpu ]; then
  echo "main job: the real model runs on the CPU; DSA_INDEXER_DEVICE=$DSA_INDEXER_DEVICE is the" \
    "pattern model's throughput run (scripts/throughput_job.sh)" >&2
  exit 2
fi
# Not passed on: dsa-attention would read it as its --indexer-device.
unset DSA_INDEXER_DEVICE

step_start=$SECONDS
if [ -n "${DSA_PREBUILT_BIN:-}" ]; then
  bin=$DSA_PREBUILT_BIN
else
  bash scripts/bootstrap.sh
fi
model_dir=$(bash scripts/model_setup.sh)
# Relative to the repository where it is inside it, as the reports name it.
model_dir=$(realpath --relative-to="$PWD" "$model_dir")
python=${DSA_MODEL_VENV:-$PWD/.venv-model}/bin/python
if [ -z "${DSA_PREBUILT_BIN:-}" ]; then
  # Only what the job runs: the dsa tool and the three servers.
  DSA_BUILD_TARGETS="dsa dsa-indexer dsa-attention dsa-coordinator" bash scripts/build.sh
fi
echo "main job: bootstrap, model setup and build took $((SECONDS - step_start)) s"
if [ ! -f "$trace" ]; then
  echo "main job: no trace at $trace: the repository carries it in data/traces/; set" \
    "DSA_REPLAY_TRACE to a Mooncake .jsonl or Azure .csv trace to use another" >&2
  exit 1
fi
mkdir -p "$out"

step_start=$SECONDS
started_marker=$(mktemp)
trap 'rm -f "$started_marker"' EXIT
rc=0
"$bin/dsa" replay --local --model smollm2 --model-file "$model_dir/model.safetensors" \
  --token-corpus "$model_dir/python_docs_heldout.npy" --trace "$trace" "${replay_args[@]}" \
  --json "$out/$name.json" --markdown "$out/$name.md" || rc=$?
replay_seconds=$((SECONDS - step_start))
# The samples of this run's report (not an earlier one's, when the replay wrote none).
if [ "$out/$name.json" -nt "$started_marker" ]; then
  echo
  echo "main job: sample outputs (the end of each context, then >>> the model's continuation):"
  PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m dsa_model.replay_samples \
    "$out/$name.json" --tokenizer "$model_dir" --markdown "$out/$name.md" ||
    { [ "$rc" != 0 ] || rc=1; }
fi
echo "main job: wrote $out/$name.json and $out/$name.md (replay $replay_seconds s, job" \
  "$((SECONDS - job_start)) s)"
if [ "$rc" != 0 ]; then
  echo "main job: the replay failed (exit $rc): see the report and the messages above" >&2
fi
exit "$rc"
