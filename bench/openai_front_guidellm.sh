#!/usr/bin/env bash
# GuideLLM (a standard OpenAI-API benchmark client) against the OpenAI-compatible front
# (docs/openai.md, "Benchmark"): `dsa up --model smollm2` on loopback, `python -m dsa_openai` in
# front of it, then `guidellm run` at 1, 4 and 8 concurrent streams, 12 requests each, synthetic
# prompts of 256 tokens (GuideLLM's count, before the chat template) and 32 output tokens
# (ignore_eos). Writes GuideLLM's tables to docs/results/openai_front_guidellm.txt (or $1).
#
# Needs: build/bin (bash scripts/build.sh), scripts/model_setup.sh's venv and model folder, and a
# venv with guidellm (made once at .venv-guidellm; it brings PyTorch, ~2 GB). The tokenizer GuideLLM
# counts with is the model's own tokenizer.json, loaded offline.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/openai_front_guidellm.txt}
bin=${DSA_BIN_DIR:-build/bin}
model_dir=${DSA_MODEL_DIR:-build/models/smollm2-135m}
venv=.venv-guidellm
if [ ! -x "$venv/bin/guidellm" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check guidellm==0.8.1
fi
work=$(mktemp -d)
cleanup() {
  [ -n "${front:-}" ] && kill "$front" 2>/dev/null || true
  [ -n "${cluster:-}" ] && kill -INT "$cluster" 2>/dev/null && wait "$cluster" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# A transformers-loadable tokenizer folder: the model's tokenizer.json and a config naming it.
mkdir -p "$work/tokenizer"
cp "$model_dir/tokenizer.json" "$work/tokenizer/"
echo '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}' \
  >"$work/tokenizer/tokenizer_config.json"

"$bin/dsa" up --model smollm2 --model-file "$model_dir/model.safetensors" --log-dir "$work" \
  >"$work/up.out" 2>"$work/up.err" &
cluster=$!
# wait_for FILE SED_SCRIPT SECONDS: prints what SED_SCRIPT extracts from FILE once it extracts
# something, polling each second; nothing after SECONDS.
wait_for() {
  local found=""
  for _ in $(seq "$3"); do
    found=$(sed -n "$2" "$1")
    [ -n "$found" ] && break
    sleep 1
  done
  echo "$found"
}
address=$(wait_for "$work/up.out" 's/^dsa up: coordinator listening on //p' 120)
[ -n "$address" ] || { cat "$work/up.err" >&2; exit 1; }
PYTHONPATH=python:clients/python .venv-model/bin/python -m dsa_openai --coordinator "$address" \
  --model-dir "$model_dir" --listen 127.0.0.1:0 >"$work/front.out" 2>&1 &
front=$!
url=$(wait_for "$work/front.out" 's/^dsa-openai: listening on \(http:[^ ]*\).*/\1/p' 60)
[ -n "$url" ] || { cat "$work/front.out" >&2; exit 1; }

{
  echo "# bench/openai_front_guidellm.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD)"
  echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
  HF_HUB_OFFLINE=1 "$venv/bin/guidellm" run \
    --backend "kind=openai_http,target=$url,model=smollm2-135m" \
    --profile kind=concurrent,streams=1 --override profile.streams 1,4,8 \
    --constraint kind=max_requests,count=12 \
    --tokenizer "kind=hf_auto,model=$work/tokenizer" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=32 \
    --output "kind=json,path=$work/benchmarks.json" --disable-progress 2>&1
} | sed 's/[[:space:]]*$//' >"$out"
echo "bench/openai_front_guidellm.sh: wrote $out" >&2
