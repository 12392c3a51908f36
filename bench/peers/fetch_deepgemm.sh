#!/usr/bin/env bash
# Assembles the DeepGEMM source tarball that bench/peers/deepgemm.sh builds on the GPU host
# (default build/peers/deepgemm-src.tar.gz, ignored). DeepGEMM is in no package of the index: its
# sources come from git, at the commits pinned here:
#   DeepGEMM  deepseek-ai/DeepGEMM  54e22612409371d6364144b69086735beb54e98b: the whole tree
#             (git archive), as DeepGEMM/;
#   cutlass   NVIDIA/cutlass        f3fde58372d33e9a5650ba7b80fc48b3b49d40c8 (DeepGEMM's submodule
#             pin): include/ and LICENSE.txt, as DeepGEMM/third-party/cutlass/;
#   fmt       fmtlib/fmt            553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28 (the submodule pin):
#             include/ and LICENSE, as DeepGEMM/third-party/fmt/;
# plus DeepGEMM/CARRY_SOURCES.txt (these pins) and the symlinks deep_gemm/include/{cute,cutlass}
# into third-party/cutlass/include that DeepGEMM's develop.sh makes. Nothing is changed.
# DEEPGEMM_GIT, CUTLASS_GIT, FMT_GIT may name existing git repositories (clones or mirrors) that
# hold those commits; those not named are fetched from GitHub (one commit, depth 1). The tarball
# is deterministic (sorted, mtime 0, owner root, gzip -n); its sha256 is printed.
# usage: [DEEPGEMM_GIT=dir] [CUTLASS_GIT=dir] [FMT_GIT=dir] bash bench/peers/fetch_deepgemm.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/peers/deepgemm-src.tar.gz}
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
dg_commit=54e22612409371d6364144b69086735beb54e98b
cutlass_commit=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8
fmt_commit=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# repo_for NAME OWNER/REPO COMMIT: prints a git directory holding COMMIT.
repo_for() {
  local given=$1 slug=$2 commit=$3 dir
  if [ -n "$given" ]; then
    dir=$given
  else
    dir=$tmp/git-${slug//\//-}
    git init -q --bare "$dir"
    echo "fetching $slug $commit" >&2
    git -C "$dir" fetch -q --depth 1 "https://github.com/$slug.git" "$commit" >&2
  fi
  if [ "$(git -C "$dir" cat-file -t "$commit" 2>/dev/null)" != commit ]; then
    echo "fetch_deepgemm: $dir does not hold $slug $commit" >&2
    return 1
  fi
  echo "$dir"
}
dg_git=$(repo_for "${DEEPGEMM_GIT:-}" deepseek-ai/DeepGEMM "$dg_commit")
cutlass_git=$(repo_for "${CUTLASS_GIT:-}" NVIDIA/cutlass "$cutlass_commit")
fmt_git=$(repo_for "${FMT_GIT:-}" fmtlib/fmt "$fmt_commit")

dg=$tmp/DeepGEMM
mkdir -p "$dg/third-party/cutlass/include" "$dg/third-party/fmt/include"
git -C "$dg_git" archive "$dg_commit" | tar -x -C "$dg"
# Subtrees (commit:path) only, so a partial clone need not hold the rest of cutlass.
git -C "$cutlass_git" archive "$cutlass_commit:include" | tar -x -C "$dg/third-party/cutlass/include"
git -C "$cutlass_git" show "$cutlass_commit:LICENSE.txt" > "$dg/third-party/cutlass/LICENSE.txt"
git -C "$fmt_git" archive "$fmt_commit:include" | tar -x -C "$dg/third-party/fmt/include"
git -C "$fmt_git" show "$fmt_commit:LICENSE" > "$dg/third-party/fmt/LICENSE"
ln -s ../../third-party/cutlass/include/cute "$dg/deep_gemm/include/cute"
ln -s ../../third-party/cutlass/include/cutlass "$dg/deep_gemm/include/cutlass"
cat > "$dg/CARRY_SOURCES.txt" <<'EOF'
DeepGEMM  deepseek-ai/DeepGEMM  54e22612409371d6364144b69086735beb54e98b  (2026-06-23, "Multiple updates and refactorings (#364)", __version__ 2.6.1)
cutlass   NVIDIA/cutlass        f3fde58372d33e9a5650ba7b80fc48b3b49d40c8  (the submodule pin; include/ and LICENSE.txt only)
fmt       fmtlib/fmt            553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28  (the submodule pin; include/ and LICENSE only)
deep_gemm/include/{cute,cutlass} are symlinks into third-party/cutlass/include, as DeepGEMM's develop.sh makes them.
EOF
tar -C "$tmp" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - DeepGEMM |
  gzip -n -9 > "$out.part"
mv "$out.part" "$out"
sha256sum "$out"
