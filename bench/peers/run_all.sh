#!/usr/bin/env bash
# Every public peer of bench/peers/ in one run on the GPU host, then one report:
#   flashinfer  bench_topk_peers (FlashInfer 0.7.4's exact, fast radix and cluster top-K, compiled
#               with ours into one binary): run_peers.sh;
#   frameworks  vLLM's, sgl-kernel's and SGLang's DSA top-K kernels beside ours (dsa_kernels):
#               frameworks/topk_peers.sh;
#   deepselect  DeepSelect (deepseek-ai/DeepSelect, built from DEEPSELECT_DIR with
#               DEEP_SELECT_CUDA_ARCHS=90a in a copy under /tmp) beside ours: deepselect_bench.py,
#               bell scores at every shape and all-equal scores at 64 x 64K and 64 x 1M;
#   deepgemm    DeepGEMM's fp8_paged_mqa_logits beside our scan: deepgemm.sh.
# Each part runs in its own processes under its own time limit (PART_LIMIT_S, default 540 s), so a
# peer that fails, crashes or runs out of time costs only its own columns. Then report.py turns
# whatever the parts wrote into OUT/peers_report.md: the top-K tables (FlashInfer's columns, the
# other harnesses' beside them, each ratio to ours timed in the peer's own process) and the scan's
# table. Everything, logs included, is packed into OUT/peers_all.tgz; run the report again
# anywhere with the command that OUT/report_command.txt records.
#
# One device call (10 minutes) holds one or two parts: the builds take 1-4 minutes each
# (deepselect's 86 instantiations the longest). Run the parts over several calls into one OUT
# (a kept OUT keeps the parts already run: each part replaces only its own folder).
#
# usage (GPU host, repo root): bash bench/peers/run_all.sh [PARTS]
#   PARTS: a comma list of flashinfer, frameworks, deepselect, deepgemm, report (default: all)
# env: OUT (default /tmp/peers_all); BIN (bench_topk_peers' folder, default build/bin);
#      FRAMEWORKS_DIR (default build/peers/frameworks: bench/peers/fetch_frameworks.sh);
#      DEEPSELECT_DIR (a DeepSelect tree, default peers-src/deepselect);
#      DG_TARBALL (default build/peers/deepgemm-src.tar.gz: bench/peers/fetch_deepgemm.sh);
#      COMMIT (the commit the report names, default git rev-parse --short HEAD);
#      DRY_RUN=1 prints each part's commands instead of running them.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
REPO=$PWD
PARTS=${1:-flashinfer,frameworks,deepselect,deepgemm,report}
OUT=${OUT:-/tmp/peers_all}
BIN=${BIN:-build/bin}
FRAMEWORKS_DIR=${FRAMEWORKS_DIR:-build/peers/frameworks}
DEEPSELECT_DIR=${DEEPSELECT_DIR:-peers-src/deepselect}
DG_TARBALL=${DG_TARBALL:-build/peers/deepgemm-src.tar.gz}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PART_LIMIT_S=${PART_LIMIT_S:-540}
DRY_RUN=${DRY_RUN:-0}
PY=${PY:-python3}
export MAX_JOBS=${MAX_JOBS:-16}

for part in ${PARTS//,/ }; do
  case $part in
    flashinfer | frameworks | deepselect | deepgemm | report) ;;
    *)
      echo "run_all: unknown part '$part' (flashinfer, frameworks, deepselect, deepgemm, report)" >&2
      exit 2
      ;;
  esac
done
mkdir -p "$OUT"
SECONDS=0
log() { echo "[run_all ${SECONDS}s] $*"; }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
# Runs a part's command under the part limit (or prints it with DRY_RUN=1); its output goes to
# OUT/<part>/run.log as well.
run_part() {
  local part=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    echo "[$part] $*"
    return 0
  fi
  rm -rf "${OUT:?}/$part"
  mkdir -p "$OUT/$part"
  log "$part: start"
  timeout "$PART_LIMIT_S" "$@" 2>&1 | tee "$OUT/$part/run.log"
  local rc=${PIPESTATUS[0]}
  log "$part: rc=$rc"
  echo "$rc" > "$OUT/$part/rc"
}

# dsa_kernels (python/), which every part but flashinfer imports: built once here when absent or
# older than its sources, so that the parts' own build checks find it up to date.
build_ours() {
  local so newer
  so=$(ls python/dsa_kernels/_C*.so 2>/dev/null | head -1)
  newer=""
  [ -n "$so" ] && newer=$(find indexer_service/cuda python/csrc python/setup.py -newer "$so" \
                          -type f | head -1)
  if [ -n "$so" ] && [ -z "$newer" ]; then return 0; fi
  if [ "$DRY_RUN" = 1 ]; then
    echo "[ours] (cd python && $PY setup.py build_ext --inplace --force)"
    return 0
  fi
  log "building dsa_kernels"
  (cd python && timeout 300 "$PY" setup.py build_ext --inplace --force) > "$OUT/dsa_build.log" 2>&1
  log "dsa_kernels build rc=$?"
}

deepselect_part() {
  local src=$1 out=$2 work=/tmp/run_all_deepselect
  if [ ! -f "$src/setup.py" ]; then
    echo "deepselect: no DeepSelect tree at $src (DEEPSELECT_DIR)" >&2
    return 2
  fi
  rm -rf "$work" && cp -r "$src" "$work" || return 2
  echo "deepselect: building $src in $work (DEEP_SELECT_CUDA_ARCHS=90a, MAX_JOBS=$MAX_JOBS)"
  (cd "$work" && DEEP_SELECT_CUDA_ARCHS=90a "$PY" setup.py build_ext --inplace) \
    > "$out/build.log" 2>&1 || { echo "deepselect: build failed"; tail -20 "$out/build.log"; return 3; }
  PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH} "$PY" bench/peers/deepselect_bench.py \
    --deepselect-dir "$work" --scores bell --out "$out/topk_deepselect_bell.json"
  PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH} "$PY" bench/peers/deepselect_bench.py \
    --deepselect-dir "$work" --scores equal --shapes 64x65536,64x1048576 \
    --out "$out/topk_deepselect_equal.json"
}

if wanted frameworks || wanted deepselect || wanted deepgemm; then build_ours; fi
if wanted flashinfer; then
  if [ -x "$BIN/bench_topk_peers" ] || [ "$DRY_RUN" = 1 ]; then
    run_part flashinfer bash bench/peers/run_peers.sh "$BIN" "$OUT/flashinfer"
  else
    log "flashinfer: no $BIN/bench_topk_peers (scripts/gpu_carry.sh builds it): skipped"
  fi
fi
if wanted frameworks; then
  run_part frameworks env OUT="$OUT/frameworks" bash bench/peers/frameworks/topk_peers.sh \
    "$FRAMEWORKS_DIR"
fi
if wanted deepselect; then
  if [ "$DRY_RUN" = 1 ]; then
    echo "[deepselect] build $DEEPSELECT_DIR, then deepselect_bench.py bell and equal"
  else
    rm -rf "${OUT:?}/deepselect" && mkdir -p "$OUT/deepselect"
    log "deepselect: start"
    export -f deepselect_part
    export REPO PY MAX_JOBS
    timeout "$PART_LIMIT_S" bash -c 'deepselect_part "$0" "$1"' "$DEEPSELECT_DIR" \
      "$OUT/deepselect" 2>&1 | tee "$OUT/deepselect/run.log"
    echo "${PIPESTATUS[0]}" > "$OUT/deepselect/rc"
    log "deepselect: rc=$(cat "$OUT/deepselect/rc")"
  fi
fi
if wanted deepgemm; then
  run_part deepgemm env OUT="$OUT/deepgemm" DEADLINE_S=$((PART_LIMIT_S - 20)) \
    bash bench/peers/deepgemm.sh "$DG_TARBALL"
  if [ "$DRY_RUN" != 1 ] && [ -f "$OUT/deepgemm/deepgemm_results.tar.gz" ]; then
    tar -xzf "$OUT/deepgemm/deepgemm_results.tar.gz" -C "$OUT/deepgemm" deepgemm_bench.json \
      2>/dev/null || true
  fi
fi

# The report over whatever the parts wrote (this run's or a kept OUT's).
if wanted report; then
  args=()
  for f in "$OUT"/flashinfer/topk_peers_bell.json "$OUT"/flashinfer/topk_peers_equal.json; do
    [ -f "$f" ] && args+=("$f")
  done
  for f in "$OUT"/frameworks/topk_frameworks_bell.json "$OUT"/frameworks/topk_frameworks_equal.json \
           "$OUT"/deepselect/topk_deepselect_bell.json "$OUT"/deepselect/topk_deepselect_equal.json; do
    [ -f "$f" ] && args+=(--extra "$f")
  done
  [ -f "$OUT/deepgemm/deepgemm_bench.json" ] && args+=(--scan "$OUT/deepgemm/deepgemm_bench.json")
  if [ ${#args[@]} -eq 0 ]; then
    log "report: no part wrote results into $OUT"
  else
    cmd=("$PY" bench/peers/report.py "${args[@]}" --commit "$COMMIT" --markdown
         "$OUT/peers_report.md")
    printf '%q ' "${cmd[@]}" > "$OUT/report_command.txt"
    echo >> "$OUT/report_command.txt"
    if [ "$DRY_RUN" = 1 ]; then
      echo "[report] $(cat "$OUT/report_command.txt")"
    else
      "${cmd[@]}" && log "report: $OUT/peers_report.md"
    fi
  fi
fi
if [ "$DRY_RUN" != 1 ]; then
  tar -czf /tmp/peers_all.tgz --exclude=peers_all.tgz -C "$(dirname "$OUT")" "$(basename "$OUT")" &&
    mv /tmp/peers_all.tgz "$OUT/peers_all.tgz"
  log "packed $OUT/peers_all.tgz"
fi
