#!/usr/bin/env bash
# The runtime packages of the images: which Debian/Ubuntu packages provide the shared libraries the
# installed binaries load. Three commands:
#   runtime-packages.sh list LIST            the package names of LIST (comments and blanks dropped)
#   runtime-packages.sh check LIST BINARY... every library BINARY needs (ldd) is owned (dpkg -S) by
#                                            a package LIST names; exit 1 otherwise, naming them
#   runtime-packages.sh resolve BINARY...    prints name=version of every package owning a library
#                                            BINARY needs (Dockerfile.cuda's runtime installs these)
# Libraries under /usr/local/cuda* that no package owns (a toolkit installed from NVIDIA's runfile,
# as on the development hosts) are reported and accepted by check: the CPU image is built without
# CUDA, and Dockerfile.cuda's builder resolves them from NVIDIA's packages instead.
set -euo pipefail

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# The resolved path of every shared library the binaries load, one a line, sorted, unique.
needed_libraries() {
  local binary
  for binary in "$@"; do
    if [ ! -f "$binary" ]; then
      echo "runtime-packages: no such file: $binary" >&2
      exit 2
    fi
    if ldd "$binary" | grep -q 'not found'; then
      echo "runtime-packages: $binary: unresolved libraries:" >&2
      ldd "$binary" | grep 'not found' >&2
      exit 1
    fi
    # "libx.so.1 => /path (addr)" and the loader's own "/lib64/ld-linux-x86-64.so.2 (addr)".
    ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
  done | sort -u
}

# The package that owns a library file, or nothing. ldd names a path through the /lib -> usr/lib
# link or a symbolic link chain, while dpkg knows the path the package shipped, so try the path
# as given, with and without the /usr prefix, its folder resolved, and the file resolved.
owning_package() {
  local path=$1 candidate owner
  local -a candidates=("$path")
  case "$path" in
    /usr/*) candidates+=("${path#/usr}") ;;
    *) candidates+=("/usr$path") ;;
  esac
  candidates+=("$(realpath "$(dirname "$path")")/$(basename "$path")" "$(realpath "$path")")
  for candidate in "${candidates[@]}"; do
    # "libgrpc29:amd64: /usr/lib/x86_64-linux-gnu/libgrpc.so.29" -> libgrpc29
    if owner=$(dpkg-query -S "$candidate" 2>/dev/null | head -n 1); then
      owner=${owner%%: *}
      echo "${owner%%:*}"
      return 0
    fi
  done
  return 0
}

list_packages() {
  sed -e 's/#.*//' -e 's/[[:space:]]\+$//' -e '/^[[:space:]]*$/d' "$1"
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
case "$cmd" in
  list)
    [ $# -eq 1 ] || usage
    list_packages "$1"
    ;;
  check)
    [ $# -ge 2 ] || usage
    list=$1
    shift
    mapfile -t listed < <(list_packages "$list")
    failures=0
    declare -A used=()
    while read -r library; do
      owner=$(owning_package "$library")
      if [ -z "$owner" ]; then
        case "$library" in
          /usr/local/cuda*)
            echo "runtime-packages: $library: the CUDA toolkit's, no package (Dockerfile.cuda's builder resolves it)"
            ;;
          *)
            echo "runtime-packages: FAIL: $library is owned by no package" >&2
            failures=$((failures + 1))
            ;;
        esac
        continue
      fi
      used[$owner]=1
      if ! printf '%s\n' "${listed[@]}" | grep -qxF "$owner"; then
        echo "runtime-packages: FAIL: $library is in package $owner, which $list does not list" >&2
        failures=$((failures + 1))
      fi
    done < <(needed_libraries "$@")
    for package in "${listed[@]}"; do
      if [ -z "${used[$package]:-}" ]; then
        echo "runtime-packages: note: $list lists $package, which no library of these binaries needs"
      fi
    done
    if [ "$failures" -ne 0 ]; then
      echo "runtime-packages: $failures libraries not covered by $list" >&2
      exit 1
    fi
    echo "runtime-packages: ok: every library of $# binaries is in a package of $list (${#used[@]} packages used)"
    ;;
  resolve)
    [ $# -ge 1 ] || usage
    while read -r library; do
      owner=$(owning_package "$library")
      if [ -z "$owner" ]; then
        echo "runtime-packages: $library is owned by no package" >&2
        exit 1
      fi
      echo "$owner"
    done < <(needed_libraries "$@") | sort -u | while read -r package; do
      echo "$package=$(dpkg-query -W -f='${Version}' "$package")"
    done
    ;;
  *)
    usage
    ;;
esac
