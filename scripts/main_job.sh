#!/usr/bin/env bash
# The main job: install what is missing, build, and run the SPIN quality evaluation (`dsa eval`) on
# the pattern model with the embedded CPU default. Results go to docs/results/ (JSON, markdown)
# and the plot to docs/eval_miss_vs_sparsity.png. Extra arguments go to `dsa eval`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/build.sh
mkdir -p docs/results
build/bin/dsa eval --json docs/results/eval.json --markdown docs/results/eval.md "$@"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 tools/plot_eval.py docs/results/eval.json docs/eval_miss_vs_sparsity.png
  echo "main job: wrote docs/results/eval.json, docs/results/eval.md, docs/eval_miss_vs_sparsity.png"
else
  echo "main job: wrote docs/results/eval.json and eval.md (no matplotlib for the plot)" >&2
fi
