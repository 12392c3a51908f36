#!/usr/bin/env bash
# The main job: install what is missing, build, and run the SPIN quality evaluation (`dsa eval`) on
# the pattern model with the embedded CPU default. Results go to $DSA_EVAL_OUT (default
# docs/results/: eval.json, eval.md) and the plot to eval_miss_vs_sparsity.png in the folder above it by
# default (docs/eval_miss_vs_sparsity.png). Extra arguments go to `dsa eval` (not --json/--markdown).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DSA_EVAL_OUT:-docs/results}
plot=${DSA_EVAL_PLOT:-$(dirname "$out")/eval_miss_vs_sparsity.png}
bash scripts/bootstrap.sh
bash scripts/build.sh
mkdir -p "$out"
build/bin/dsa eval --json "$out/eval.json" --markdown "$out/eval.md" "$@"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 tools/plot_eval.py "$out/eval.json" "$plot"
  echo "main job: wrote $out/eval.json, $out/eval.md and $plot"
else
  echo "main job: wrote $out/eval.json and $out/eval.md (no matplotlib for the plot)" >&2
fi
