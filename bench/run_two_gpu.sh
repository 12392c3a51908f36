#!/usr/bin/env bash
# The remote indexer on two GPUs of one host: the indexer worker on GPU 1, the attention side on GPU 0,
# selections over NCCL (NVLink; multicast off: NCCL_NVLS_ENABLE=0), against the gRPC stream and
# the same-GPU arms. Steps (DSA_TWO_GPU_STEPS, default "rtt decode_same decode_two faults replay";
# "decode" is both decode steps), each writing into OUT (default docs/results/two_gpu);
# OUT/README.md gathers what OUT holds, and DSA_TWO_GPU_ARCHIVE=FILE packs OUT into FILE (.tgz).
# Each step fits a 10-minute device call; run them as separate calls where a call is bounded.
#   rtt:         bench_remote_select_rtt against a dsa-indexer on GPU 1: the per-layer round trip
#                (submit a layer's inputs, receive its selections) over NCCL and over the gRPC
#                SelectStream, interleaved, at 1, 8 and 64 rows of 8,192+ slots -> rtt.{md,json}
#                (target: NCCL <= 20 us p50 at 1 row)
#   decode_same: bench_engine_decode_step at DSA_TWO_GPU_SHAPES (default 1x131072,64x65536) with
#                the indexer on GPU 0 beside the attention (serial, co-located MLI: inprocess,
#                device), nvidia-smi sampling GPU 0 -> decode_same_gpu.{json,txt}, busy_same_gpu.csv
#   decode_two:  the same shapes (the batch the same-GPU run settled on) with a dsa-indexer process
#                on GPU 1 over NCCL (remote, remote_serial), its select time scraped from its
#                metrics -> decode_two_gpu.{json,txt}, indexer_select_seconds.csv
#                Both write decode.md: step times per arm; the attention GPU's busy fraction
#                estimated as the ceiling arm's step over the arm's; GPU 0's nvidia-smi busy in
#                the same-GPU run; the indexer GPU's busy fraction in the two-GPU run as its
#                select time over the window (nvidia-smi cannot tell there: NCCL's posted
#                receives are kernels that wait, counted busy)
#   faults:      dsa replay --local with 2 dsa-indexer on GPU 1 and 1 dsa-attention on GPU 0 over
#                NCCL, 128 Mooncake requests; DSA_TWO_GPU_FAULT_AFTER_S (5) after the cluster is
#                ready, the first dsa-indexer gets SIGKILL -> faults.md: completed / failed,
#                migrations, when the coordinator marked the worker not ready and first migrated a
#                request, the attention worker's first UNAVAILABLE after the kill, requests that
#                arrived after the mark and ended on the dead worker, the replay's length (bounded:
#                DSA_TWO_GPU_FAULT_TIMEOUT_S, default 180, past which it is a hang)
#   replay:      the main job's Mooncake replay with both workers on GPUs over NCCL
#                (DSA_PREBUILT_BIN path) -> replay_mooncake_two_gpu_nccl.{json,md}
# A step that fails is reported and the others still run; exit status 1 if any failed.
# DSA_TWO_GPU_SMOKE=1 checks the script itself without a GPU: every process on the CPU, the gRPC
# stream instead of NCCL, small shapes and counts (its figures measure nothing).
#
# usage (on the GPU host, after scripts/gpu_carry.sh here; carry DIR and .devrt):
#   export LD_LIBRARY_PATH=$PWD/.devrt:/usr/local/cuda/lib64
#   DSA_TWO_GPU_STEPS=rtt DSA_TWO_GPU_ARCHIVE=$OUT/two_gpu.tgz bash bench/run_two_gpu.sh DIR /tmp/two_gpu
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
bin=$(realpath "${1:?usage: bash bench/run_two_gpu.sh BIN_DIR [OUT]}")
out=${2:-docs/results/two_gpu}
steps=()
for step in ${DSA_TWO_GPU_STEPS:-rtt decode_same decode_two faults replay}; do
  if [ "$step" = decode ]; then steps+=(decode_same decode_two); else steps+=("$step"); fi
done
shapes=${DSA_TWO_GPU_SHAPES:-1x131072,64x65536}
trace=$bin/mooncake_conversation_trace.jsonl
[ -f "$trace" ] || trace=data/traces/mooncake_conversation_trace.jsonl
export NCCL_NVLS_ENABLE=0
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA's ordinals as nvidia-smi numbers the GPUs
# dsa-attention reads DSA_INDEXER_DEVICE as its co-located indexer's flag: never pass it on.
unset DSA_INDEXER_DEVICE
fault_after_s=${DSA_TWO_GPU_FAULT_AFTER_S:-5}
fault_timeout_s=${DSA_TWO_GPU_FAULT_TIMEOUT_S:-180}
smoke=${DSA_TWO_GPU_SMOKE:-0}
if [ "$smoke" = 1 ]; then
  shapes=${DSA_TWO_GPU_SHAPES:-1x2048,4x1024}
  device=cpu planes=grpc rtt_iterations=100 rtt_context=1024 fault_requests=16
  decode_args=(--device cpu --layers 2 --steps 3 --batch-steps 2 --warmup 1 --batch-warmup 1)
  cluster_args=(--transport grpc --indexer-device cpu --attention-device cpu)
  replay_env=(DSA_INDEXER_DEVICE=cpu "DSA_REPLAY_ARGS=--limit 8 --max-context 2048 --max-output 8 --time-scale 0")
else
  device=cuda planes=grpc,nccl rtt_iterations=3000 rtt_context=8192 fault_requests=128
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

# Stops process $1: SIGTERM, up to 20 s, then SIGKILL to it and its children (a cluster's
# children run in their own process groups).
stop_proc() {
  local p=$1
  kill "$p" 2>/dev/null || return 0
  for _ in $(seq 200); do
    kill -0 "$p" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$p" 2>/dev/null; then
    pkill -9 -P "$p" 2>/dev/null
    kill -9 "$p" 2>/dev/null
  fi
  wait "$p" 2>/dev/null
}
cleanup() {
  for p in "${pids[@]}"; do stop_proc "$p"; done
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
# (and indexer_metrics, host:port of its /metrics) once it serves (60 s at most); its pid is the
# last of pids.
indexer_address="" indexer_metrics=""
start_indexer() {
  local gpu=$1 blocks=$2 log=$3 line
  indexer_address="" indexer_metrics=""
  local placement=(--device cpu)
  [ "$device" = cpu ] || placement=(--device cuda --cuda-device "$gpu")
  "$bin/dsa-indexer" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 "${placement[@]}" \
    --capacity-blocks "$blocks" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do
    line=$(grep -m1 '"msg":"serving"' "$log" 2>/dev/null)
    if [ -n "$line" ]; then
      indexer_address=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["address"])' "$line")
      indexer_metrics=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("metrics_address", ""))' "$line")
      return 0
    fi
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "dsa-indexer on GPU $gpu did not start:" >&2
  tail -5 "$log" >&2
  stop_last
  return 1
}
stop_last() {
  stop_proc "${pids[-1]}"
  unset 'pids[-1]'
}

failed=()
step_rtt() {
  start_indexer 1 32768 "$out/rtt_indexer.log" || return 1
  # One set of sequences per R (no renewal: the context grows from 8,192 by the iterations).
  "$bin/bench_remote_select_rtt" --indexer "$indexer_address" --transports "$planes" --cuda-device 0 \
    --rows 1,8,64 --iterations "$rtt_iterations" --warmup $((rtt_iterations / 10)) \
    --context-slots "$rtt_context" --steps-per-sequence $((rtt_iterations * 2)) \
    --json "$out/rtt.json" --out "$out/rtt.md"
  local rc=$?
  stop_last
  return $rc
}

# Writes decode.md from whichever of decode_same_gpu.json and decode_two_gpu.json exist.
decode_report() {
  python3 - "$out" >"$out/decode.md" <<'PY'
import csv, datetime, json, os, sys
out = sys.argv[1]
gpu0 = []  # (unix seconds, busy %) of GPU 0 during the same-GPU run
path = os.path.join(out, "busy_same_gpu.csv")
if os.path.exists(path):
    for row in csv.reader(open(path)):
        try:
            if int(row[1]) == 0:
                t = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                gpu0.append((t, float(row[2])))
        except (ValueError, IndexError):
            pass
selects = []  # (unix seconds, the remote indexer's select seconds so far)
path = os.path.join(out, "indexer_select_seconds.csv")
if os.path.exists(path):
    for row in csv.reader(open(path)):
        try:
            selects.append((float(row[0]), float(row[1])))
        except (ValueError, IndexError):
            pass
def nvidia_busy(window):
    v = [b for t, b in gpu0 if window[0] <= t <= window[1]]
    return f"{sum(v) / len(v) / 100:.2f}" if v else "-"
def indexer_busy(window):
    inside = [(t, s) for t, s in selects if window[0] <= t <= window[1]]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return "-"
    return f"{(inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]):.2f}"
print("| run | shape | set | stand-in | arm | step ms p50 | layer us | hidden vs serial "
      "| attention GPU busy (est.) | GPU 0 busy (nvidia-smi) | indexer GPU busy (selects) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name in ("decode_same_gpu", "decode_two_gpu"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    for shape in d.get("shapes", []):
        label = f'{shape["batch"]} x {shape["context"]}'
        for set_name, s in shape["sets"].items():
            window = s.get("decode_window_unix", [0, 0])
            same = name == "decode_same_gpu"
            for standin in ("bare", "standin"):
                cells = s.get(standin, {})
                ceiling = cells.get("ceiling", {}).get("step_ms_p50")
                for arm, c in cells.items():
                    hidden = c.get("hidden_vs_serial_same_set")
                    est = f'{ceiling / c["step_ms_p50"]:.2f}' if ceiling else "-"
                    print(f'| {name[7:]} | {label} | {set_name} | {standin} | {arm} '
                          f'| {c["step_ms_p50"]:.2f} | {c["layer_us"]:.1f} '
                          f'| {"-" if hidden is None else f"{hidden:.3f}"} | {est} '
                          f'| {nvidia_busy(window) if same else "-"} '
                          f'| {"-" if same else indexer_busy(window)} |')
print()
print("- attention GPU busy (est.): the ceiling arm's step time (attention and stand-in, no "
      "indexer) over the arm's, same set and stand-in setting.")
print("- GPU 0 busy (nvidia-smi): utilization.gpu, mean of the 100 ms samples inside the set's "
      "decode window (all its arms: the indexer arms interleaved step by step, then the "
      "ceiling); the indexer and the attention share GPU 0 there.")
print("- indexer GPU busy (selects): the remote dsa-indexer's select time "
      "(dsa_indexer_select_duration_seconds, every phase; device event times on the GPU) over "
      "the same window, from its metrics scraped every 200 ms. nvidia-smi's figure would read "
      "1.00 there: NCCL's posted receives are kernels that wait.")
PY
}

step_decode_same() {
  local sampler="" rc=0
  : >"$out/busy_same_gpu.csv"
  if [ "$smoke" != 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used \
      --format=csv,noheader,nounits -lms 100 -f "$out/busy_same_gpu.csv" &
    sampler=$!
  fi
  "$bin/bench_engine_decode_step" --shapes "$shapes" ${decode_args[@]+"${decode_args[@]}"} \
    --json "$out/decode_same_gpu.json" >"$out/decode_same_gpu.txt" 2>&1 || rc=1
  [ -z "$sampler" ] || stop_proc "$sampler"
  decode_report || rc=1
  return $rc
}

step_decode_two() {
  local rc=0 blocks two_shapes=$shapes poller
  # The batch the same-GPU run settled on (its prefill budget may have halved one), when it ran.
  if [ -f "$out/decode_same_gpu.json" ]; then
    two_shapes=$(python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
print(",".join("%dx%d" % (s["batch"], s["context"]) for s in d["shapes"]))' \
      "$out/decode_same_gpu.json") || return 1
  fi
  # The remote indexer's capacity: what the bench says the shapes need.
  blocks=$("$bin/bench_engine_decode_step" --shapes "$two_shapes" \
    ${decode_args[@]+"${decode_args[@]}"} --remote-indexer unused:1 --print-index-blocks) ||
    return 1
  start_indexer 1 "$blocks" "$out/decode_indexer.log" || return 1
  # The indexer's select seconds so far (every phase's histogram sum), every 200 ms.
  python3 - "$indexer_metrics" >"$out/indexer_select_seconds.csv" <<'PY' &
import re, sys, time, urllib.request
url = f"http://{sys.argv[1]}/metrics"
pattern = re.compile(r'^dsa_indexer_select_duration_seconds_sum\{[^}]*\} (\S+)$', re.M)
while True:
    try:
        text = urllib.request.urlopen(url, timeout=1).read().decode()
        print(f"{time.time():.3f},{sum(float(v) for v in pattern.findall(text)):.6f}", flush=True)
    except OSError:
        pass
    time.sleep(0.2)
PY
  poller=$!
  "$bin/bench_engine_decode_step" --shapes "$two_shapes" ${decode_args[@]+"${decode_args[@]}"} \
    --prefill-budget-s 1000000 --remote-indexer "$indexer_address" \
    --remote-transport "${planes##*,}" --json "$out/decode_two_gpu.json" \
    >"$out/decode_two_gpu.txt" 2>&1 || rc=1
  stop_proc "$poller"
  stop_last
  decode_report || rc=1
  return $rc
}

step_faults() {
  local run=$work/faults replay victim killed_at rc=0 status=0
  mkdir -p "$run/logs"
  "$bin/dsa" replay --local --bin-dir "$bin" --log-dir "$run/logs" "${cluster_args[@]}" \
    --indexers 2 --attention-workers 1 --trace "$trace" --limit "$fault_requests" \
    --max-context 8192 --max-output 64 --time-scale 0 --max-in-flight 16 --draft-length 2 \
    --capacity-blocks 65536 --json "$run/report.json" >"$run/replay.out" 2>&1 &
  replay=$!
  pids+=("$replay")
  for _ in $(seq 3000); do
    grep -q "local cluster ready" "$run/replay.out" 2>/dev/null && break
    kill -0 "$replay" 2>/dev/null || break
    sleep 0.1
  done
  sleep "$fault_after_s"
  victim=$(pgrep -o -x -P "$replay" dsa-indexer || true)
  if [ -z "$victim" ]; then
    echo "faults: no dsa-indexer of the replay (pid $replay) $fault_after_s s after it was ready" >&2
    tail -20 "$run/replay.out" >&2
    stop_last
    return 1
  fi
  killed_at=$(date +%s.%N)
  kill -9 "$victim"
  for _ in $(seq $((fault_timeout_s * 10))); do
    kill -0 "$replay" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$replay" 2>/dev/null; then
    echo "faults: the replay did not end within $fault_timeout_s s of the kill (a hang)" >&2
    rc=1
    stop_last
  else
    wait "$replay" || status=$?
    unset 'pids[-1]'
    # dsa replay exits 1 for a cluster process that died (its line names it); anything else fails.
    if [ "$status" != 0 ] && ! { [ "$status" = 1 ] && grep -qE \
      "^dsa replay: INTERNAL: unclean stop: dsa-indexer-[0-9]+ exited with 137 \(killed\);[^;]*$" \
      "$run/replay.out"; }; then
      echo "faults: dsa replay exited with $status" >&2
      rc=1
    fi
  fi
  cp "$run/replay.out" "$out/faults_replay.out"
  rm -rf "$out/faults_logs"
  cp -r "$run/logs" "$out/faults_logs"
  python3 - "$run" "$killed_at" "$victim" "$fault_after_s" >"$out/faults.md" <<'PY' || rc=1
import datetime, glob, json, os, sys
run, killed_at, victim, after_s = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
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
path = os.path.join(run, "report.json")
report = json.load(open(path)) if os.path.exists(path) else {}
q = report.get("requests", {})
lat = report.get("latency_seconds", {})
after = lambda t: "never" if t is None else f"{t - killed_at:.2f} s"
print("| figure | value |\n|---|---|")
print(f"| killed | dsa-indexer pid {victim} ({dead}), SIGKILL {after_s} s after the cluster was ready |")
print(f"| completed / failed | {q.get('completed', '?')} / {q.get('failed', '?')} "
      f"({q.get('failures_by_code', {})}) |")
print(f"| migrations | {q.get('migrations', '?')} ({q.get('migrated_requests', '?')} requests) |")
print(f"| coordinator marked it not ready | {after(not_ready)} after the kill |")
print(f"| first migration | {after(migrated)} after the kill |")
print(f"| attention worker's first UNAVAILABLE | {after(unavailable)} after the kill |")
print(f"| requests that arrived after the mark and ended on it | {late} |")
print(f"| inter-token p50 / max | {lat.get('inter_token_p50', 0) * 1e3:.1f} ms / "
      f"{lat.get('inter_token_max', 0):.2f} s |")
print(f"| replay wall time | {report.get('wall_seconds', '?')} s |")
PY
  return $rc
}

step_replay() {
  env DSA_PREBUILT_BIN="$bin" DSA_REPLAY_TRACE="$trace" DSA_EVAL_OUT="$out" \
    DSA_REPLAY_NAME=replay_mooncake_two_gpu_nccl "${replay_env[@]}" bash scripts/throughput_job.sh
}

for step in "${steps[@]}"; do
  echo "== run_two_gpu: $step ($(date -u +%H:%M:%S))"
  case $step in
    rtt) step_rtt || failed+=(rtt) ;;
    decode_same) step_decode_same || failed+=(decode_same) ;;
    decode_two) step_decode_two || failed+=(decode_two) ;;
    faults) step_faults || failed+=(faults) ;;
    replay) step_replay || failed+=(replay) ;;
    *)
      echo "run_two_gpu: unknown step '$step' (rtt, decode_same, decode_two, decode, faults, replay)" >&2
      failed+=("$step")
      ;;
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
  echo "Last call's steps: ${steps[*]}; failed: ${failed[*]:-none}."
} >"$out/README.md"
cat "$out/README.md"
if [ -n "${DSA_TWO_GPU_ARCHIVE:-}" ]; then
  tar czf "$DSA_TWO_GPU_ARCHIVE" -C "$out" . && echo "run_two_gpu: packed $out into $DSA_TWO_GPU_ARCHIVE"
fi
[ ${#failed[@]} -eq 0 ]
