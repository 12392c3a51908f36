#!/usr/bin/env bash
# Runs clang-tidy (.clang-tidy; warnings are errors) over the library and tool sources, using the
# compile commands and header dependencies of the build in ${DSA_BUILD_DIR:-build}. Tests,
# benchmarks and the fuzz harnesses (built only with clang, scripts/fuzz.sh) are not checked.
#
# usage: bash scripts/check_tidy.sh            the sources that changed since .ci/tidy_base
#        bash scripts/check_tidy.sh --all      every source (about 8 minutes on 2 cores)
#        bash scripts/check_tidy.sh --all --record   the same, then writes HEAD to .ci/tidy_base
#
# .ci/tidy_base names the newest commit whose whole tree passed a full run. The default mode checks
# every source that differs from it, or that includes (directly or not, per Ninja's dependency log)
# a project file that differs from it, committed or not; a change to .clang-tidy, a base that is not
# in the history, or a build without a dependency log means a full run.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSA_BUILD_DIR:-build}
all=0
record=0
for arg in "$@"; do
  case $arg in
    --all) all=1 ;;
    --record) record=1 ;;
    *) echo "check_tidy: unknown argument '$arg' (--all, --record)" >&2; exit 2 ;;
  esac
done
mapfile -t sources < <(git ls-files '*.cc' | grep -v -E '^(tests|bench|fuzz)/')
base=$(cat .ci/tidy_base 2>/dev/null || true)
if [ $all = 0 ]; then
  if [ -z "$base" ] || ! git cat-file -e "$base^{commit}" 2>/dev/null; then
    echo "check_tidy: no usable .ci/tidy_base ('$base'): a full run" >&2
    all=1
  elif ! ninja -C "$build_dir" -t deps >"$build_dir/tidy_deps.txt" 2>/dev/null; then
    echo "check_tidy: no dependency log in $build_dir: a full run" >&2
    all=1
  fi
fi
if [ $all = 0 ]; then
  changed=$( { git diff --name-only "$base" --; git ls-files --others --exclude-standard; } | sort -u)
  if grep -qxF .clang-tidy <<<"$changed"; then
    echo "check_tidy: .clang-tidy changed since $base: a full run" >&2
    all=1
  else
    # The sources among `sources` that are changed or depend on a changed file.
    mapfile -t sources < <(python3 - "$build_dir" "$build_dir/tidy_deps.txt" \
      <(printf '%s\n' "$changed") <(printf '%s\n' "${sources[@]}") <<'PY'
import os, sys
build, deps_path, changed_path, sources_path = sys.argv[1:5]
root = os.getcwd()
changed = {l.strip() for l in open(changed_path) if l.strip()}
wanted = {l.strip() for l in open(sources_path) if l.strip()}
picked, files = set(), []
def flush():
    if files and files[0] in wanted and any(f in changed for f in files):
        picked.add(files[0])
for line in open(deps_path):
    if not line.startswith((" ", "\t")):  # "object: #deps N, ..." starts an object's list
        flush()
        files = []
    elif line.strip():
        path = os.path.relpath(os.path.normpath(os.path.join(build, line.strip())), root)
        files.append(path)
flush()
# Sources with no object yet (new files) are checked whenever they changed.
picked |= {s for s in wanted if s in changed}
print("\n".join(sorted(picked)))
PY
)
    [ -n "${sources[0]:-}" ] || sources=()
    echo "check_tidy: ${#sources[@]} sources changed since $base or include a changed file" >&2
  fi
fi
if [ ${#sources[@]} -gt 0 ]; then
  # clang-tidy counts the warnings it suppressed in system headers on stderr: drop those lines only.
  printf '%s\n' "${sources[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$build_dir" --quiet 2>&1 |
    { grep -v -E '^[0-9]+ warnings? generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter' || true; }
fi
echo "check_tidy: ${#sources[@]} files clean"
if [ $all = 1 ] && [ $record = 1 ]; then
  git diff --quiet HEAD -- || { echo "check_tidy: --record needs a clean tree" >&2; exit 1; }
  git rev-parse HEAD >.ci/tidy_base
  echo "check_tidy: .ci/tidy_base = $(cat .ci/tidy_base); commit it" >&2
fi
