#!/usr/bin/env bash
# Every public peer of bench/peers/ in one run on the GPU host, then one report:
#   flashinfer  bench_topk_peers (FlashInfer 0.7.4's exact, fast radix and cluster top-K, compiled
#               with ours into one binary): run_peers.sh;
#   frameworks  vLLM's, sgl-kernel's and SGLang's DSA top-K kernels beside ours (dsa_kernels):
#               frameworks/topk_peers.sh;
#   deepselect  DeepSelect (deepseek-ai/DeepSelect, built from DEEPSELECT_DIR with
#               DEEP_SELECT_CUDA_ARCHS=90a in a copy under /tmp) beside ours: deepselect_bench.py,
#               bell scores at every shape and all-equal scores at 64 x 64K and 64 x 1M;
#   deepgemm    DeepGEMM's fp8_paged_mqa_logits beside our scan: deepgemm.sh;
#   report      report.py over whatever the parts wrote into OUT (this run's or a kept OUT's):
#               OUT/peers_report.md, the top-K tables (one for FlashInfer's modes, one for each
#               other peer, each ratio to ours timed in the peer's own process) and the scan's.
# Each part runs in its own processes under its own time limit: what is left of DEADLINE_S (the
# whole run, default 580 s: a device call's 600 less the packing), at most PART_LIMIT_S (default
# 540 s). A peer that fails, crashes or runs out of time costs only its own columns; whatever it
# wrote before stays in OUT. The exit status counts the parts that failed. Everything, logs
# included, is packed into OUT/peers_all.tgz; OUT/report_command.txt records the report's command.
#
# A part can take most of a 10-minute device call (the frameworks' own limits add up to 600 s;
# DeepSelect's 86 instantiations take minutes to build): run the parts over several calls into one
# OUT (each part replaces only its own folder), the report last.
#
# usage (GPU host, repo root or anywhere): bash bench/peers/run_all.sh [PARTS]
#   PARTS: a comma list of flashinfer, frameworks, deepselect, deepgemm, report (default: all)
# env: OUT (default /tmp/peers_all); BIN (bench_topk_peers' folder, default build/bin);
#      FRAMEWORKS_DIR (default build/peers/frameworks: bench/peers/fetch_frameworks.sh);
#      DEEPSELECT_DIR (a DeepSelect tree, default peers-src/deepselect);
#      DG_TARBALL (default build/peers/deepgemm-src.tar.gz: bench/peers/fetch_deepgemm.sh);
#      relative paths are from the repo root; COMMIT (the commit the report names, default
#      git rev-parse --short HEAD); DRY_RUN=1 prints each part's command and writes nothing.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
REPO=$PWD
PARTS=${1:-flashinfer,frameworks,deepselect,deepgemm,report}
PARTS=${PARTS// /}
OUT=$(realpath -m "${OUT:-/tmp/peers_all}")
BIN=$(realpath -m "${BIN:-build/bin}")
FRAMEWORKS_DIR=$(realpath -m "${FRAMEWORKS_DIR:-build/peers/frameworks}")
DEEPSELECT_DIR=$(realpath -m "${DEEPSELECT_DIR:-peers-src/deepselect}")
DG_TARBALL=$(realpath -m "${DG_TARBALL:-build/peers/deepgemm-src.tar.gz}")
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEADLINE_S=${DEADLINE_S:-580}
PART_LIMIT_S=${PART_LIMIT_S:-540}
DRY_RUN=${DRY_RUN:-0}
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
[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"
SECONDS=0
failed=0
log() { echo "[run_all ${SECONDS}s] $*"; }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
# Seconds a part may take: what is left of the run's deadline, at most PART_LIMIT_S.
limit() {
  local left=$((DEADLINE_S - SECONDS))
  echo $((left < PART_LIMIT_S ? left : PART_LIMIT_S))
}
# Runs a part's command under its limit (or prints it with DRY_RUN=1), its output also in
# OUT/<part>/run.log and its status in OUT/<part>/rc.
run_part() {
  local part=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    echo "[$part] $*"
    return 0
  fi
  local secs
  secs=$(limit)
  rm -rf "${OUT:?}/$part"
  mkdir -p "$OUT/$part"
  if [ "$secs" -lt 30 ]; then
    log "$part: not started, ${secs}s left of the deadline"
    echo 124 > "$OUT/$part/rc"
    failed=$((failed + 1))
    return 0
  fi
  log "$part: start (limit ${secs}s)"
  timeout -k 10 "$secs" "$@" 2>&1 | tee "$OUT/$part/run.log"
  local rc=${PIPESTATUS[0]}
  log "$part: rc=$rc"
  echo "$rc" > "$OUT/$part/rc"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

# dsa_kernels (python/), which every part but flashinfer imports: built once here when absent or
# older than its sources (build_ours.sh), so that the parts' own checks find it up to date.
build_ours() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "[ours] bash bench/peers/build_ours.sh $OUT/dsa_build.log"
    return 0
  fi
  bash bench/peers/build_ours.sh "$OUT/dsa_build.log" "$(limit)" | while read -r line; do log "$line"; done
}

# DeepSelect built in a copy of $1, then its bench into $2 (bell, then all-equal); the status is
# the first failure's.
deepselect_part() {
  local src=$1 out=$2 work=/tmp/run_all_deepselect rc=0
  if [ ! -f "$src/setup.py" ]; then
    echo "deepselect: no DeepSelect tree at $src (DEEPSELECT_DIR)" >&2
    return 2
  fi
  rm -rf "$work" && cp -r "$src" "$work" || return 2
  echo "deepselect: building $src in $work (DEEP_SELECT_CUDA_ARCHS=90a, MAX_JOBS=$MAX_JOBS)"
  if ! (cd "$work" && DEEP_SELECT_CUDA_ARCHS=90a python3 setup.py build_ext --inplace) \
    > "$out/build.log" 2>&1; then
    echo "deepselect: build failed"
    tail -20 "$out/build.log"
    return 3
  fi
  export PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH}
  python3 bench/peers/deepselect_bench.py --deepselect-dir "$work" --scores bell \
    --out "$out/topk_deepselect_bell.json" || rc=$?
  python3 bench/peers/deepselect_bench.py --deepselect-dir "$work" --scores equal \
    --shapes 64x65536,64x1048576 --out "$out/topk_deepselect_equal.json" ||
    { local second=$?; [ "$rc" = 0 ] && rc=$second; }
  return "$rc"
}

if wanted frameworks || wanted deepselect || wanted deepgemm; then build_ours; fi
if wanted flashinfer; then
  if [ -x "$BIN/bench_topk_peers" ] || [ "$DRY_RUN" = 1 ]; then
    run_part flashinfer bash bench/peers/run_peers.sh "$BIN" "$OUT/flashinfer"
  else
    log "flashinfer: no $BIN/bench_topk_peers (scripts/gpu_carry.sh builds it): not run"
    failed=$((failed + 1))
  fi
fi
if wanted frameworks; then
  run_part frameworks env OUT="$OUT/frameworks" bash bench/peers/frameworks/topk_peers.sh \
    "$FRAMEWORKS_DIR"
fi
if wanted deepselect; then
  export -f deepselect_part
  export REPO
  run_part deepselect bash -c 'deepselect_part "$0" "$1"' "$DEEPSELECT_DIR" "$OUT/deepselect"
fi
if wanted deepgemm; then
  run_part deepgemm env OUT="$OUT/deepgemm" DEADLINE_S="$(($(limit) - 20))" \
    bash bench/peers/deepgemm.sh "$DG_TARBALL"
  if [ "$DRY_RUN" != 1 ]; then
    if [ -f "$OUT/deepgemm/deepgemm_results.tar.gz" ]; then
      tar -xzf "$OUT/deepgemm/deepgemm_results.tar.gz" -C "$OUT/deepgemm" deepgemm_bench.json \
        2>/dev/null || true
    elif [ -f /tmp/dgp/deepgemm_bench.json ]; then
      # Cut before deepgemm.sh packed: its work folder still holds what the bench wrote.
      cp /tmp/dgp/deepgemm_bench.json /tmp/dgp/deepgemm_*.log "$OUT/deepgemm/" 2>/dev/null
    fi
  fi
fi

if wanted report; then
  if [ "$DRY_RUN" = 1 ]; then
    echo "[report] python3 bench/peers/report.py <the JSONs the parts wrote in $OUT> --commit" \
      "$COMMIT --markdown $OUT/peers_report.md"
  else
    args=()
    for f in "$OUT"/flashinfer/topk_peers_bell.json "$OUT"/flashinfer/topk_peers_equal.json; do
      [ -f "$f" ] && args+=("$f")
    done
    for f in "$OUT"/frameworks/topk_frameworks_{bell,equal}.json \
             "$OUT"/deepselect/topk_deepselect_{bell,equal}.json; do
      [ -f "$f" ] && args+=(--extra "$f")
    done
    [ -f "$OUT/deepgemm/deepgemm_bench.json" ] && args+=(--scan "$OUT/deepgemm/deepgemm_bench.json")
    if [ ${#args[@]} -eq 0 ]; then
      log "report: no part wrote results into $OUT"
      failed=$((failed + 1))
    else
      cmd=(python3 bench/peers/report.py "${args[@]}" --commit "$COMMIT" --markdown
           "$OUT/peers_report.md")
      printf '%q ' "${cmd[@]}" > "$OUT/report_command.txt"
      echo >> "$OUT/report_command.txt"
      if "${cmd[@]}"; then
        log "report: $OUT/peers_report.md"
      else
        log "report: failed"
        failed=$((failed + 1))
      fi
    fi
  fi
fi
if [ "$DRY_RUN" != 1 ]; then
  if tar -czf /tmp/peers_all.tgz --exclude=peers_all.tgz -C "$(dirname "$OUT")" \
       "$(basename "$OUT")" && mv /tmp/peers_all.tgz "$OUT/peers_all.tgz"; then
    log "packed $OUT/peers_all.tgz"
  else
    log "packing failed"
    failed=$((failed + 1))
  fi
fi
log "done: $failed part(s) failed"
exit $((failed > 0 ? 1 : 0))
