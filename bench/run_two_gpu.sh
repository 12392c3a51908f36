#!/usr/bin/env bash
# Issue 11 on two GPUs of one host: the indexer worker on GPU 1, the attention side on GPU 0,
# selections over NCCL (NVLink; multicast off: NCCL_NVLS_ENABLE=0), against the gRPC stream and
# the same-GPU arms, in one run. Steps (DSA_TWO_GPU_STEPS, default "rtt decode faults replay"),
# each writing into OUT (default docs/results/two_gpu); OUT/README.md gathers them:
#   rtt:    bench_remote_select_rtt against a dsa-indexer on GPU 1: the per-layer round trip
#           (submit a layer's inputs, receive its selection) over NCCL and over the gRPC
#           SelectStream, interleaved, at 1, 8 and 64 rows -> rtt.{md,json}
#           (target: NCCL <= 20 us p50 at 1 row)
#   decode: bench_engine_decode_step at DSA_TWO_GPU_SHAPES (default 1x131072,64x65536), first with
#           the indexer on GPU 0 beside the attention (serial, co-located MLI: inprocess, device),
#           then with a dsa-indexer process on GPU 1 over NCCL (remote, remote_serial); nvidia-smi
#           samples both GPUs' busy fraction every 100 ms -> decode_same_gpu.{json,txt},
#           decode_two_gpu.{json,txt}, busy.csv, decode.md (step times per arm, and each GPU's
#           mean busy fraction inside each set's decode window)
#   faults: dsa replay --local with 2 dsa-indexer on GPU 1 and 1 dsa-attention on GPU 0 over NCCL,
#           64 Mooncake requests; 15 s in, the first dsa-indexer is killed with SIGKILL ->
#           faults.md: completed / failed, migrations, when the coordinator marked the worker not
#           ready and first migrated a request, the attention worker's first UNAVAILABLE after
#           the kill, requests that finished on the dead worker after it was marked, the replay's
#           length (bounded: DSA_TWO_GPU_FAULT_TIMEOUT_S, default 600)
#   replay: the main job's Mooncake replay with both workers on GPUs over NCCL (DSA_PREBUILT_BIN
#           path) -> replay_mooncake_two_gpu_nccl.{json,md}
# A step that fails is reported and the others still run; exit status 1 if any failed.
# DSA_TWO_GPU_SMOKE=1 checks the script itself without a GPU: every process on the CPU, the gRPC
# stream instead of NCCL, small shapes and counts (its figures measure nothing).
#
# usage (on the GPU host, after scripts/gpu_carry.sh here; carry DIR and .devrt):
#   export LD_LIBRARY_PATH=$PWD/.devrt:/usr/local/cuda/lib64
#   bash bench/run_two_gpu.sh DIR [OUT]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
bin=$(realpath "${1:?usage: bash bench/run_two_gpu.sh BIN_DIR [OUT]}")
out=${2:-docs/results/two_gpu}
steps=${DSA_TWO_GPU_STEPS:-rtt decode faults replay}
shapes=${DSA_TWO_GPU_SHAPES:-1x131072,64x65536}
trace=$bin/mooncake_conversation_trace.jsonl
[ -f "$trace" ] || trace=data/traces/mooncake_conversation_trace.jsonl
export NCCL_NVLS_ENABLE=0
smoke=${DSA_TWO_GPU_SMOKE:-0}
if [ "$smoke" = 1 ]; then
  shapes=${DSA_TWO_GPU_SHAPES:-1x2048,4x1024}
  device=cpu planes=grpc rtt_iterations=100 fault_requests=16 fault_kill_s=5
  decode_args=(--device cpu --layers 2 --steps 3 --batch-steps 2 --warmup 1 --batch-warmup 1)
  cluster_args=(--transport grpc --indexer-device cpu --attention-device cpu)
  replay_env=(DSA_INDEXER_DEVICE=cpu "DSA_REPLAY_ARGS=--limit 8 --max-context 2048 --max-output 8 --time-scale 0")
else
  device=cuda planes=grpc,nccl rtt_iterations=3000 fault_requests=64 fault_kill_s=15
  decode_args=()
  cluster_args=(--transport nccl --indexer-device cuda --indexer-cuda-devices 1
    --attention-device cuda --attention-cuda-devices 0)
  replay_nccl="--transport nccl --indexer-cuda-devices 1 --attention-device cuda"
  replay_env=(DSA_INDEXER_DEVICE=cuda "DSA_REPLAY_EXTRA_ARGS=$replay_nccl --attention-cuda-devices 0")
fi
mkdir -p "$out"
out=$(realpath "$out")
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "$smoke" != 1 ] && [ "${gpus:-0}" -lt 2 ]; then
  echo "run_two_gpu: needs two GPUs, found ${gpus:-0} (nvidia-smi -L)" >&2
  exit 2
fi
{
  echo "- commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if [ "$smoke" = 1 ]; then
    echo "- DSA_TWO_GPU_SMOKE=1: all on the CPU over gRPC, a check of the script (no figure measures anything)"
  else
    echo "- $(nvidia-smi -L | head -2 | tr '\n' ';' | sed 's/;$//')"
    echo "- GPU link: $(nvidia-smi topo -m 2>/dev/null | awk '$1 == "GPU0" {print $3}')" \
      "(nvidia-smi topo -m, GPU0 to GPU1); NCCL_NVLS_ENABLE=0"
  fi
  echo "- $(nproc) CPU cores: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
} >"$out/machine.md"

# Starts a dsa-indexer on GPU $1 with --capacity-blocks $2, logging to $3; sets indexer_address
# to its address once it serves (60 s at most); its pid is the last of pids.
indexer_address=""
start_indexer() {
  local gpu=$1 blocks=$2 log=$3
  indexer_address=""
  local placement=(--device cpu)
  [ "$device" = cpu ] || placement=(--device cuda --cuda-device "$gpu")
  "$bin/dsa-indexer" --listen 127.0.0.1:0 --metrics-listen none "${placement[@]}" \
    --capacity-blocks "$blocks" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do
    indexer_address=$(grep -m1 '"msg":"serving"' "$log" 2>/dev/null |
      python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["address"])' 2>/dev/null)
    [ -n "$indexer_address" ] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "dsa-indexer on GPU $gpu did not start:" >&2
  tail -5 "$log" >&2
  stop_last
  return 1
}
stop_last() {
  local p=${pids[-1]}
  kill "$p" 2>/dev/null
  wait "$p" 2>/dev/null
  unset 'pids[-1]'
}

failed=()
step_rtt() {
  start_indexer 1 4096 "$out/rtt_indexer.log" || return 1
  "$bin/bench_remote_select_rtt" --indexer "$indexer_address" --transports "$planes" --cuda-device 0 \
    --rows 1,8,64 --iterations "$rtt_iterations" --warmup $((rtt_iterations / 10)) \
    --json "$out/rtt.json" --out "$out/rtt.md"
  local rc=$?
  stop_last
  return $rc
}

step_decode() {
  local sampler rc=0
  : >"$out/busy.csv"
  if [ "$smoke" != 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used \
      --format=csv,noheader,nounits -lms 100 >"$out/busy.csv" &
    sampler=$!
    pids+=("$sampler")
  fi
  "$bin/bench_engine_decode_step" --shapes "$shapes" ${decode_args[@]+"${decode_args[@]}"} \
    --json "$out/decode_same_gpu.json" >"$out/decode_same_gpu.txt" 2>&1 || rc=1
  # The remote indexer's capacity: what the bench says the shapes need.
  local blocks
  blocks=$("$bin/bench_engine_decode_step" --shapes "$shapes" ${decode_args[@]+"${decode_args[@]}"} \
    --remote-indexer unused:1 --print-index-blocks) || return 1
  if start_indexer 1 "$blocks" "$out/decode_indexer.log"; then
    "$bin/bench_engine_decode_step" --shapes "$shapes" ${decode_args[@]+"${decode_args[@]}"} \
      --remote-indexer "$indexer_address" --remote-transport "${planes##*,}" \
      --json "$out/decode_two_gpu.json" >"$out/decode_two_gpu.txt" 2>&1 || rc=1
    stop_last
  else
    rc=1
  fi
  [ -z "${sampler:-}" ] || kill "$sampler" 2>/dev/null
  python3 - "$out" >"$out/decode.md" <<'PY' || rc=1
import csv, datetime, json, os, sys
out = sys.argv[1]
samples = []  # (unix seconds, gpu, busy %)
for row in csv.reader(open(os.path.join(out, "busy.csv"))):
    try:
        t = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, int(row[1]), float(row[2])))
    except (ValueError, IndexError):
        pass
def busy(window, gpu):
    v = [b for t, g, b in samples if g == gpu and window[0] <= t <= window[1]]
    return f"{sum(v) / len(v) / 100:.2f}" if v else "-"
print("| run | shape | set | stand-in | arm | step ms p50 | layer us | hidden vs serial | GPU 0 busy | GPU 1 busy |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in ("decode_same_gpu", "decode_two_gpu"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    for shape in d.get("shapes", []):
        label = f'{shape["batch"]} x {shape["context"]}'
        for set_name, s in shape["sets"].items():
            window = s.get("decode_window_unix", [0, 0])
            for standin in ("bare", "standin"):
                for arm, c in s.get(standin, {}).items():
                    hidden = c.get("hidden_vs_serial_same_set")
                    print(f'| {name[7:]} | {label} | {set_name} | {standin} | {arm} '
                          f'| {c["step_ms_p50"]:.2f} | {c["layer_us"]:.1f} '
                          f'| {"-" if hidden is None else f"{hidden:.3f}"} '
                          f'| {busy(window, 0)} | {busy(window, 1)} |')
print()
print("Busy: nvidia-smi utilization.gpu (share of time a kernel ran), mean of the 100 ms samples "
      "inside the set's decode window (every arm of the set, interleaved step by step).")
PY
  return $rc
}

step_faults() {
  local run=$work/faults replay victim killed_at rc=0
  mkdir -p "$run/logs"
  "$bin/dsa" replay --local --bin-dir "$bin" --log-dir "$run/logs" "${cluster_args[@]}" \
    --indexers 2 --attention-workers 1 --trace "$trace" --limit "$fault_requests" \
    --max-context 8192 --max-output 64 --time-scale 0 --max-in-flight 16 --draft-length 2 \
    --capacity-blocks 65536 --json "$run/report.json" >"$run/replay.out" 2>&1 &
  replay=$!
  pids+=("$replay")
  sleep "$fault_kill_s"
  victim=$(pgrep -o -P "$replay" -f "$bin/dsa-indexer" || true)
  if [ -z "$victim" ]; then
    echo "faults: no dsa-indexer started by the replay (pid $replay) after $fault_kill_s s" >&2
    tail -20 "$run/replay.out" >&2
    return 1
  fi
  killed_at=$(date +%s.%N)
  kill -9 "$victim"
  local limit=${DSA_TWO_GPU_FAULT_TIMEOUT_S:-600}
  for _ in $(seq $((limit * 10))); do
    kill -0 "$replay" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$replay" 2>/dev/null; then
    echo "faults: the replay did not end within $limit s of the kill (a hang)" >&2
    kill "$replay"
    rc=1
  fi
  # The replay ends with "INTERNAL: unclean stop" naming the killed worker; anything else fails.
  if ! wait "$replay" && ! grep -qE \
    "^dsa replay: INTERNAL: unclean stop: dsa-indexer-[0-9]+ exited with 137 \(killed\);[^;]*$" \
    "$run/replay.out"; then
    rc=1
  fi
  cp "$run/replay.out" "$out/faults_replay.out"
  cp -r "$run/logs" "$out/faults_logs"
  python3 - "$run" "$killed_at" "$victim" "$fault_kill_s" >"$out/faults.md" <<'PY' || rc=1
import datetime, glob, json, os, sys
run, killed_at, victim, kill_s = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
def lines(pattern):
    for path in glob.glob(os.path.join(run, "logs", pattern)):
        for line in open(path, errors="replace"):
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                entry["_t"] = datetime.datetime.fromisoformat(
                    entry["ts"].replace("Z", "+00:00")).timestamp()
                yield path, entry
# The killed indexer's address: the replay lists each process's pid and address.
dead = None
for line in open(os.path.join(run, "replay.out"), errors="replace"):
    f = line.split()
    if len(f) >= 5 and f[0].startswith("dsa-indexer-") and f[1:3] == ["pid", victim]:
        dead = f[4]
if dead is None:
    sys.exit(f"faults: pid {victim} is not among the replay's dsa-indexer processes")
not_ready = min((e["_t"] for _, e in lines("dsa-coordinator*.log")
                 if e.get("msg") == "worker not ready" and e.get("address") == dead
                 and e["_t"] >= killed_at), default=None)
migrated = min((e["_t"] for _, e in lines("dsa-coordinator*.log")
                if e.get("msg") == "migrating a request off a failed worker"
                and e["_t"] >= killed_at), default=None)
unavailable = min((e["_t"] for _, e in lines("dsa-attention*.log")
                   if "UNAVAILABLE" in json.dumps(e) and e["_t"] >= killed_at), default=None)
late = sum(1 for _, e in lines("dsa-coordinator*.log")
           if e.get("msg") == "request" and e.get("indexer_worker") == dead
           and not_ready is not None and e["_t"] - e.get("duration_s", 0) > not_ready)
report = json.load(open(os.path.join(run, "report.json"))) if os.path.exists(
    os.path.join(run, "report.json")) else {}
q = report.get("requests", {})
lat = report.get("latency_seconds", {})
after = lambda t: "never" if t is None else f"{t - killed_at:.2f} s"
print("| figure | value |\n|---|---|")
print(f"| killed | dsa-indexer pid {victim} ({dead}), SIGKILL {kill_s} s into the replay |")
print(f"| completed / failed | {q.get('completed', '?')} / {q.get('failed', '?')} "
      f"({q.get('failures_by_code', {})}) |")
print(f"| migrations | {q.get('migrations', '?')} ({q.get('migrated_requests', '?')} requests) |")
print(f"| coordinator marked it not ready | {after(not_ready)} after the kill |")
print(f"| first migration | {after(migrated)} after the kill |")
print(f"| attention worker's first UNAVAILABLE | {after(unavailable)} after the kill |")
print(f"| requests placed on it after it was marked | {late} |")
print(f"| inter-token p50 / max | {lat.get('inter_token_p50', 0) * 1e3:.1f} ms / "
      f"{lat.get('inter_token_max', 0):.2f} s |")
print(f"| replay wall time | {report.get('wall_seconds', '?')} s |")
PY
  return $rc
}

step_replay() {
  env DSA_PREBUILT_BIN="$bin" DSA_REPLAY_TRACE="$trace" DSA_EVAL_OUT="$out" \
    DSA_REPLAY_NAME=replay_mooncake_two_gpu_nccl "${replay_env[@]}" bash scripts/main_job.sh
}

for step in $steps; do
  echo "== run_two_gpu: $step ($(date -u +%H:%M:%S))"
  case $step in
    rtt) step_rtt || failed+=(rtt) ;;
    decode) step_decode || failed+=(decode) ;;
    faults) step_faults || failed+=(faults) ;;
    replay) step_replay || failed+=(replay) ;;
    *) echo "run_two_gpu: unknown step '$step' (rtt, decode, faults, replay)" >&2; failed+=("$step") ;;
  esac
done
{
  echo "# Two H200s: the indexer on its own GPU, selections over NCCL (\`bash bench/run_two_gpu.sh\`)"
  echo
  cat "$out/machine.md"
  for part in rtt decode faults; do
    [ -f "$out/$part.md" ] || continue
    echo
    echo "## $part"
    echo
    cat "$out/$part.md"
  done
  if [ -f "$out/replay_mooncake_two_gpu_nccl.md" ]; then
    echo
    echo "## replay"
    echo
    sed 1d "$out/replay_mooncake_two_gpu_nccl.md"
  fi
  echo
  echo "Steps run: $steps; failed: ${failed[*]:-none}."
} >"$out/README.md"
cat "$out/README.md"
[ ${#failed[@]} -eq 0 ]
