#!/usr/bin/env bash
# Checks the image definitions without a container engine: hadolint (the pinned venv's, rules in
# .hadolint.yaml) on deploy/docker/Dockerfile and Dockerfile.cuda, and, when build/bin holds the
# binaries, that the CPU image's runtime package list (deploy/docker/runtime-packages-debian12.txt)
# provides every shared library they load (ldd + dpkg; deploy/docker/runtime-packages.sh).
# DSA_BIN_DIR: the binaries' folder (default build/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)

"$bin/hadolint" --config .hadolint.yaml deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda
echo "check_images: hadolint passed ($("$bin/hadolint" --version))"

if ! command -v dpkg-query >/dev/null; then
  echo "check_images: no dpkg on this host; runtime package checks skipped"
  exit 0
fi
# The check must fail when a list lacks a package: /usr/bin/true needs libc6, this list has none.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
echo zlib1g >"$scratch/list"
if bash deploy/docker/runtime-packages.sh check "$scratch/list" /usr/bin/true >/dev/null 2>&1; then
  echo "check_images: FAIL: runtime-packages.sh check passed a list without libc6" >&2
  exit 1
fi

bin_dir=${DSA_BIN_DIR:-build/bin}
binaries=()
for name in dsa-coordinator dsa-indexer dsa-attention dsa; do
  if [ -x "$bin_dir/$name" ]; then
    binaries+=("$bin_dir/$name")
  fi
done
if [ ${#binaries[@]} -eq 0 ]; then
  echo "check_images: no binaries in $bin_dir; runtime package check skipped"
  exit 0
fi
bash deploy/docker/runtime-packages.sh check deploy/docker/runtime-packages-debian12.txt "${binaries[@]}"
