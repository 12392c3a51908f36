#!/usr/bin/env bash
# Checks and times the real model's GPU path (SmolLM2-135M, docs/model.md; the LlamaRunner of
# attention_worker/cuda/llama_cuda_runner.h) on the lent GPU host, which can neither install nor
# build and receives at most 64 MiB a call (working tree included): the binaries, built here, and
# the 98 MB GGUF travel in parts over consecutive calls (scripts/carry_parts.sh), as
# scripts/train_indexer_gpu.sh's do; the host converts the GGUF (python/dsa_model/convert.py,
# with the carried gguf wheel).
#
#   prepare   (here) builds, in build-gpu/ with CUDA for sm_90a, the GPU tests, bench_llama_decode,
#             dsa-attention and dsa; packs them with the shared libraries they need
#             (scripts/pack_runtime.sh), the gguf wheel, the indexer inputs of the CUDA
#             indexer-scores test (computed here by the CPU test) and dsa eval's held-out tokens
#             and pass-key cases into .carry-model/run.tgz; and
#             splits run.tgz and the GGUF over .carry-model/p1 .. pN, each call's carry plus the
#             working tree under 64 MiB (run.tgz in p1). Prints the calls.
#   device    (there, once per call, carrying .carry-model/pI in call I) stages what it finds in
#             /tmp/dsa_model_check. Once run.tgz is there (call 1): the GPU tests (the kernels
#             against their CPU reference, the GPU runner against the CPU runner on random models,
#             the engine over the GPU runner, the service's CUDA scoring of the real model's indexer
#             inputs), the kernel and runner tests under compute-sanitizer,
#             and the benchmark on random weights of SmolLM2's shapes on the GPU. Once the GGUF is
#             whole (the last call): its conversion, the runner test on SmolLM2 itself (CPU against
#             GPU), the benchmark on SmolLM2 (GPU and CPU), and dsa-attention --model smollm2
#             --attention-device cuda started, its /metrics read, and stopped; with
#             DSA_MODEL_CHECK_EVAL=1, then `dsa eval --model smollm2 --device cuda` (every arm,
#             docs/eval.md; DSA_EVAL_ARGS adds flags; best in a call of its own: run the last
#             call again with the variable set; once per distinct DSA_EVAL_ARGS, stopped after
#             DSA_EVAL_TIMEOUT seconds (560) with the cells it finished). Everything into
#             $OUT (at most 6 files a call). A call that finds parts missing says which is next.
#             The calls must follow each other before the machine goes idle (30 s): a fresh
#             machine has an empty /tmp, and the sequence starts again at call 1.
#
# Dry run here (no GPU: the GPU tests skip, the benchmark runs on the CPU with small settings,
# dsa-attention starts on the CPU; the GGUF is reassembled and converted with .venv-model):
#   bash scripts/gpu_model_check.sh prepare
#   DSA_MODEL_CHECK_DRY_RUN=1 bash scripts/gpu_model_check.sh device
# Settings (environment): DSA_BUILD_DIR (build-gpu), DSA_BUILD_JOBS, DSA_BENCH_ARGS (more
# bench_llama_decode flags, e.g. "--steps 20"), DSA_MODEL_CHECK_CPU_BENCH (1: the bench's CPU arm
# on SmolLM2 too; 0 skips it), DSA_MODEL_CHECK_EVAL (1: dsa eval too), DSA_EVAL_ARGS, DSA_PYTHON
# (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/carry_parts.sh
source scripts/carry_parts.sh

carry_dir=.carry-model
carry_manifest=model_check.manifest
carry_chunk=gguf.chunk
gguf_wheel=gguf==0.19.0
tests="attention_cuda_gqa_attention_test attention_cuda_llama_runner_test
attention_cuda_llama_engine_test attention_cuda_llama_indexer_scores_test"
binaries="$tests bench_llama_decode dsa-attention dsa"
indexer_weights=data/models/smollm2_indexer.safetensors

die() { echo "gpu_model_check: $*" >&2; exit 1; }

prepare() {
  local build=${DSA_BUILD_DIR:-build-gpu} model_dir gguf size sha tree run_bytes run_sha parts
  DSA_BUILD_DIR=$build DSA_CMAKE_ARGS="-DDSA_ENABLE_CUDA=ON ${DSA_CMAKE_ARGS:-}" \
    DSA_BUILD_TARGETS="$(echo $binaries) attention_llama_indexer_scores_test" bash scripts/build.sh
  model_dir=$(bash scripts/model_setup.sh)
  gguf=$(PYTHONPATH="$PWD/python" "${DSA_MODEL_PYTHON:-$PWD/.venv-model/bin/python}" -c \
    "from dsa_model.convert import find_gguf; print(find_gguf())")
  [ -f "$gguf" ] || die "no GGUF at '$gguf' (bash scripts/model_setup.sh installs it)"
  [ -d "$model_dir" ] || die "no model folder"
  grep -qxF "/$carry_dir/" .git/info/exclude 2>/dev/null || echo "/$carry_dir/" >>.git/info/exclude
  rm -rf "$carry_dir"
  mkdir -p "$carry_dir/run/bin" "$carry_dir/run/devrt" "$carry_dir/run/wheel" "$carry_dir/run/eval"
  for b in $binaries; do cp "$build/bin/$b" "$carry_dir/run/bin/"; done
  # What the GPU host cannot make without the backend here: the indexer inputs the CUDA
  # indexer-scores test checks (computed by the CPU test), and dsa eval's held-out tokens and
  # pass-key cases.
  DSA_INDEXER_SCORES_INPUTS=$PWD/$carry_dir/run/eval/indexer_scores_inputs.safetensors \
    "$build/bin/attention_llama_indexer_scores_test" >/dev/null
  cp "$model_dir/python_docs_heldout.npy" "$carry_dir/run/eval/"
  [ -f "$model_dir/needles.json" ] && cp "$model_dir/needles.json" "$carry_dir/run/eval/"
  bash scripts/pack_runtime.sh "$carry_dir/run/devrt" "$carry_dir"/run/bin/*
  # The gguf wheel: the one train_indexer_gpu.sh fetched, else pip.
  local wheel
  wheel=$(ls .carry-train/p*/gguf-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    cp "$wheel" "$carry_dir/run/wheel/"
  else
    "${DSA_PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      -d "$carry_dir/run/wheel" "$gguf_wheel"
  fi
  tar -C "$carry_dir/run" -czf "$carry_dir/run.tgz" bin devrt wheel eval
  rm -rf "$carry_dir/run"
  run_bytes=$(stat -c %s "$carry_dir/run.tgz")
  run_sha=$(sha256sum "$carry_dir/run.tgz" | cut -d' ' -f1)
  tree=$(carry_tree_bytes)
  # p1: run.tgz and the GGUF's first chunk; then full calls.
  carry_split "$gguf" "$carry_dir" "$carry_manifest" "$carry_chunk" "$tree" fill "$run_bytes" 0 \
    "run_sha256=$run_sha"
  mv "$carry_dir/run.tgz" "$carry_dir/p1/"
  size=$(carry_field "$carry_dir/p1/$carry_manifest" size)
  sha=$(carry_field "$carry_dir/p1/$carry_manifest" sha256)
  parts=$(carry_field "$carry_dir/p1/$carry_manifest" parts)
  echo "gpu_model_check: run.tgz $run_bytes bytes; GGUF $size bytes, sha256 $sha, in $parts" \
    "parts; working tree $tree bytes"
  carry_check_calls "$carry_dir" "$tree"
  echo "  command of every call: bash scripts/gpu_model_check.sh device   (timeout_s 600)"
}

# Runs "$@" with its output into $OUT/$log (and the terminal); a failure is recorded, not fatal.
run_logged() {
  local log=$1 status=0
  shift
  echo "+ $*" | tee -a "$out/$log"
  "$@" 2>&1 | tee -a "$out/$log" || status=${PIPESTATUS[0]}
  echo "= exit $status: $*" | tee -a "$out/$log"
  [ "$status" = 0 ] || failures="$failures $log($1)"
  return 0
}

device() {
  local dry=${DSA_MODEL_CHECK_DRY_RUN:-0} stage python name run_sha
  failures=""
  if [ "$dry" = 1 ]; then
    stage=/tmp/dsa_model_check_dry
    python=${DSA_PYTHON:-$PWD/.venv-model/bin/python}
    out=${OUT:-$stage/out}
  else
    stage=/tmp/dsa_model_check
    python=${DSA_PYTHON:-python3}
    out=${OUT:?OUT must name the output folder (the device tool sets it)}
  fi
  mkdir -p "$stage" "$out"
  carry_stage "$carry_dir" "$stage" "$carry_manifest"
  run_sha=$(carry_field "$stage/$carry_manifest" run_sha256)
  local run=$stage/run
  export LD_LIBRARY_PATH=$run/devrt:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:/usr/local/cuda/bin  # compute-sanitizer

  # ---- The binaries: the GPU tests and the random-weights benchmark, once ----
  if [ -f "$stage/run.tgz" ] && [ ! -f "$run/.extracted" ]; then
    [ "$(sha256sum "$stage/run.tgz" | cut -d' ' -f1)" = "$run_sha" ] || \
      die "run.tgz's sha256 differs from the manifest's: re-run prepare and all calls"
    rm -rf "$run" && mkdir -p "$run" && tar -C "$run" -xzf "$stage/run.tgz"
    touch "$run/.extracted"
  fi
  [ -f "$run/.extracted" ] || die "run.tgz not staged: carry $carry_dir/p1 first"
  export DSA_INDEXER_SCORES_INPUTS=$run/eval/indexer_scores_inputs.safetensors
  if [ ! -f "$stage/tests.done" ]; then
    if command -v nvidia-smi >/dev/null; then
      run_logged host.log nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
        --format=csv
    fi
    for t in $tests; do
      run_logged gpu_tests.log "$run/bin/$t"
    done
    if command -v compute-sanitizer >/dev/null && [ "$dry" != 1 ]; then
      run_logged sanitizer.log timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$run/bin/attention_cuda_gqa_attention_test" --gtest_filter='*EdgeCases*:*GqaPrefill*'
      run_logged sanitizer.log timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$run/bin/attention_cuda_llama_runner_test" \
        --gtest_filter='*/Tiny:*DensePrefillAndDecodeEqualTheCpu/SmolShaped'
    fi
    local random_args=(--random-weights --devices cuda)
    [ "$dry" = 1 ] && random_args=(--random-weights --devices cpu --contexts 100,300
      --batches 1,2 --steps 2 --warmup 1 --prefill-repeats 1)
    # shellcheck disable=SC2086
    run_logged bench_random.txt "$run/bin/bench_llama_decode" "${random_args[@]}" \
      --out "$out/bench_random.json" ${DSA_BENCH_ARGS:-}
    touch "$stage/tests.done"
  fi

  # ---- The GGUF: whole yet? ----
  if ! carry_complete "$carry_dir" "$stage" "$carry_manifest" "$carry_chunk"; then
    [ -z "$failures" ] || die "failed:$failures"
    return 0
  fi
  carry_reassemble "$stage" "$carry_manifest" "$carry_chunk"
  name=$(carry_field "$stage/$carry_manifest" name)
  if [ ! -f "$stage/model/model.safetensors" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$stage/site" "$run"/wheel/gguf-*.whl
    PYTHONPATH="$stage/site:$PWD/python" "$python" -m dsa_model.convert --out "$stage/model" \
      --gguf "$stage/$name" 2>&1 | tee "$out/convert.log"
  fi
  local model_file=$stage/model/model.safetensors
  [ -f "$model_file" ] || die "the conversion wrote no $model_file"

  # ---- SmolLM2 itself: CPU against GPU, the benchmark, dsa-attention (once) ----
  if [ ! -f "$stage/smollm2.done" ]; then
    DSA_SMOLLM2_MODEL=$model_file DSA_SMOLLM2_INDEXER=$PWD/$indexer_weights \
      run_logged smollm2.log "$run/bin/attention_cuda_llama_runner_test" --gtest_filter='*RealModel*'
    local devices=cuda,cpu bench_args=()
    [ "${DSA_MODEL_CHECK_CPU_BENCH:-1}" = 1 ] || devices=cuda
    [ "$dry" = 1 ] && { devices=cpu; bench_args=(--contexts 128,512 --batches 1,2 --steps 2
      --warmup 1 --prefill-repeats 1); }
    # shellcheck disable=SC2086
    run_logged bench_smollm2.txt "$run/bin/bench_llama_decode" --model-file "$model_file" \
      --indexer-weights "$indexer_weights" --devices "$devices" "${bench_args[@]}" \
      --out "$out/bench_smollm2.json" ${DSA_BENCH_ARGS:-}
    attention_smoke "$run" "$model_file" "$([ "$dry" = 1 ] && echo cpu || echo cuda)"
    touch "$stage/smollm2.done"
  fi

  # ---- dsa eval --model smollm2 on the GPU (DSA_MODEL_CHECK_EVAL=1; docs/eval.md) ----
  # One run per distinct DSA_EVAL_ARGS; a time limit (DSA_EVAL_TIMEOUT seconds, 560) stops it
  # with its finished cells written (dsa eval writes each as it ends).
  local eval_done
  eval_done=$stage/eval.$(echo "${DSA_EVAL_ARGS:-}" | sha256sum | cut -c1-12).done
  if [ "${DSA_MODEL_CHECK_EVAL:-0}" = 1 ] && [ ! -f "$eval_done" ]; then
    local eval_args=(--device cuda)
    [ "$dry" = 1 ] && eval_args=(--device cpu --quick)
    local needles=none
    [ -f "$run/eval/needles.json" ] && needles=$run/eval/needles.json
    # shellcheck disable=SC2086
    run_logged eval.log timeout "${DSA_EVAL_TIMEOUT:-560}" "$run/bin/dsa" eval --model smollm2 \
      "${eval_args[@]}" \
      --model-file "$model_file" --indexer-weights "$indexer_weights" \
      --heldout-tokens "$run/eval/python_docs_heldout.npy" --needles "$needles" \
      --json "$out/eval_smollm2.json" --markdown "$out/eval_smollm2.md" ${DSA_EVAL_ARGS:-}
    touch "$eval_done"
  fi

  {
    echo "== gpu_model_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    grep -h -E "^\[  (PASSED|FAILED|SKIPPED) \]|^= exit" "$out"/*.log 2>/dev/null || true
    sed -n '/^dev /,$p' "$out/bench_smollm2.txt" 2>/dev/null || true
    echo "failures:${failures:- none}"
  } | tee "$out/summary.txt"
  [ -z "$failures" ] || die "failed:$failures"
}

# dsa-attention --model smollm2 on `device`: starts, serves /metrics, stops on SIGTERM.
attention_smoke() {
  local run=$1 model_file=$2 device=$3 log=$out/smollm2.log pid metrics="" listen=""
  echo "+ dsa-attention --model smollm2 --attention-device $device" | tee -a "$log"
  "$run/bin/dsa-attention" --model smollm2 --attention-device "$device" \
    --model-file "$model_file" --indexer-weights "$indexer_weights" --transport inprocess \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 >"$stage/attention.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    metrics=$(sed -n 's|.*metrics on \(http://[^ ]*\).*|\1|p' "$stage/attention.log" | head -1)
    listen=$(sed -n 's|.*listening on \([^ ]*\).*|\1|p' "$stage/attention.log" | head -1)
    { [ -n "$metrics" ] && [ -n "$listen" ]; } && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  local ok=0
  if [ -n "$metrics" ] && "${DSA_PYTHON:-python3}" -c "import sys, urllib.request; \
body = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(); \
print(len(body), 'bytes of /metrics'); sys.exit(0 if 'dsa_' in body else 1)" "$metrics" \
    >>"$log" 2>&1; then
    ok=1
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local status=0
  wait "$pid" || status=$?
  cat "$stage/attention.log" >>"$log"
  echo "= dsa-attention on $device: listening '$listen', metrics '$metrics', /metrics read $ok," \
    "exit $status after SIGTERM" | tee -a "$log"
  { [ "$ok" = 1 ] && [ "$status" = 0 ]; } || failures="$failures smollm2.log(dsa-attention)"
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) die "usage: $0 prepare | device   (see the header)" ;;
esac
