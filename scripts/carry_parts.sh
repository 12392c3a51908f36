#!/usr/bin/env bash
# Sourced by scripts/gpu_model_check.sh and scripts/train_indexer_gpu.sh: carries a file too big
# for one call of the lent GPU host (at most 64 MiB a call, working tree included) in parts over
# consecutive calls, and reassembles it there. Run from the repository root; errors go to stderr
# prefixed with the calling script's name, and exit.
#
# Here (prepare):
#   tree=$(carry_tree_bytes)
#   carry_split FILE DIR MANIFEST CHUNK TREE LAYOUT FIRST_EXTRA LAST_EXTRA [KEY=VALUE ...]
#     cuts FILE into DIR/p1/CHUNK1 .. DIR/pN/CHUNKN, each call's carry plus the working tree
#     (TREE bytes) under the limit with FIRST_EXTRA bytes more to go into p1 and LAST_EXTRA into
#     pN (the caller puts them there afterwards), and writes DIR/pI/MANIFEST into every part:
#     name (FILE's), size, sha256, parts, then each KEY=VALUE as a line. LAYOUT: fill (every call
#     full but the last) or even (the calls of equal size).
#   carry_field DIR/p1/MANIFEST KEY           a manifest's value (parts, size, sha256, ...)
#   carry_check_calls DIR TREE                prints each call's bytes; fails over the limit
# There (device, once per call):
#   carry_stage DIR STAGE MANIFEST            copies every carried DIR/pI into STAGE
#   if ! carry_complete DIR STAGE MANIFEST CHUNK; then ... fi
#                                             fails, saying which part to carry next, while
#                                             parts are missing
#   carry_reassemble STAGE MANIFEST CHUNK     STAGE/<name>, its size and sha256 checked

carry_call_limit=$((64 * 1024 * 1024))
carry_call_margin=$((2 * 1024 * 1024))
carry_part_reserve=4096  # each part's folder entry and manifest
carry_prog=${0##*/}
carry_prog=${carry_prog%.sh}

carry_die() { echo "$carry_prog: $*" >&2; exit 1; }

# The bytes a device call carries of the working tree: git's tracked and untracked, not ignored,
# regular files (a tracked file deleted here counts nothing).
carry_tree_bytes() {
  git ls-files -z --cached --others --exclude-standard \
    | { xargs -0 stat -c '%F %s' 2>/dev/null || true; } \
    | awk '$1 == "regular" {s += $NF} END {print s + 0}'
}

carry_field() { sed -n "s/^$2=//p" "$1"; }

carry_split() {
  local file=$1 dir=$2 manifest=$3 chunk=$4 tree=$5 layout=$6 first_extra=$7 last_extra=$8
  shift 8
  local size sha budget total parts each first bytes offset=0 i
  size=$(stat -c %s "$file")
  sha=$(sha256sum "$file" | cut -d' ' -f1)
  budget=$((carry_call_limit - carry_call_margin - carry_part_reserve - tree))
  [ "$budget" -gt $((first_extra + last_extra + 1024 * 1024)) ] || carry_die "working tree of" \
    "$tree bytes and $((first_extra + last_extra)) bytes beside ${file##*/}'s parts leave no room"
  total=$((size + first_extra + last_extra))
  parts=$(((total + budget - 1) / budget))
  case $layout in
    fill) each=$budget ;;
    even) each=$(((total + parts - 1) / parts)) ;;
    *) carry_die "carry_split: layout '$layout' is neither fill nor even" ;;
  esac
  first=$((each - first_extra))
  [ "$first" -ge 0 ] || first=0
  for i in $(seq 1 "$parts"); do
    if [ "$i" = 1 ]; then bytes=$first; else bytes=$each; fi
    if [ "$i" = "$parts" ] || [ $((offset + bytes)) -gt "$size" ]; then
      bytes=$((size - offset))
    fi
    mkdir -p "$dir/p$i"
    dd if="$file" of="$dir/p$i/$chunk$i" iflag=skip_bytes,count_bytes bs=1M skip="$offset" \
      count="$bytes" status=none
    offset=$((offset + bytes))
    {
      printf 'name=%s\nsize=%s\nsha256=%s\nparts=%s\n' "${file##*/}" "$size" "$sha" "$parts"
      [ "$#" = 0 ] || printf '%s\n' "$@"
    } >"$dir/p$i/$manifest"
  done
}

carry_check_calls() {
  local dir=$1 tree=$2 i=1 bytes
  while [ -d "$dir/p$i" ]; do
    bytes=$(du -cb "$dir/p$i" | tail -1 | cut -f1)
    [ $((bytes + tree)) -le "$carry_call_limit" ] || \
      carry_die "call $i would carry $((bytes + tree)) bytes, over $carry_call_limit"
    echo "  call $i: carry [\"$dir/p$i\"]  ($bytes bytes + tree = $((bytes + tree))" \
      "of $carry_call_limit)"
    i=$((i + 1))
  done
}

carry_stage() {
  local dir=$1 stage=$2 manifest=$3 d key
  mkdir -p "$stage"
  for d in "$dir"/p*; do
    if [ -d "$d" ]; then cp -f "$d"/* "$stage"/; fi
  done
  [ -f "$stage/$manifest" ] || carry_die "no $dir/pI carried and nothing staged in $stage:" \
    "run 'prepare' here and carry $dir/p1 in the first call"
  for key in name size sha256 parts; do
    [ -n "$(carry_field "$stage/$manifest" "$key")" ] || \
      carry_die "$stage/$manifest has no $key: re-run prepare and all calls"
  done
}

# Called as a condition (so without errexit): nothing in it may fail but its verdict.
carry_complete() {
  local dir=$1 stage=$2 manifest=$3 chunk=$4 name parts i missing="" next
  name=$(carry_field "$stage/$manifest" name)
  parts=$(carry_field "$stage/$manifest" parts)
  for i in $(seq 1 "$parts"); do
    [ -f "$stage/$chunk$i" ] || missing="$missing $i"
  done
  [ -n "$missing" ] || return 0
  next=${missing# }
  echo "$carry_prog: staged in $stage:" "$stage/$chunk"*
  echo "$carry_prog: parts of $name still missing:$missing of $parts; next call: carry" \
    "[\"$dir/p${next%% *}\"] (before the machine idles 30 s; a fresh machine needs p1 again)"
  return 1
}

carry_reassemble() {
  local stage=$1 manifest=$2 chunk=$3 name size sha parts i
  name=$(carry_field "$stage/$manifest" name)
  size=$(carry_field "$stage/$manifest" size)
  sha=$(carry_field "$stage/$manifest" sha256)
  parts=$(carry_field "$stage/$manifest" parts)
  if [ ! -f "$stage/$name" ] || [ "$(sha256sum "$stage/$name" | cut -d' ' -f1)" != "$sha" ]; then
    for i in $(seq 1 "$parts"); do cat "$stage/$chunk$i"; done >"$stage/$name.tmp"
    [ "$(stat -c %s "$stage/$name.tmp")" = "$size" ] || carry_die "reassembled $name is" \
      "$(stat -c %s "$stage/$name.tmp") bytes, expected $size: re-run prepare and all calls"
    [ "$(sha256sum "$stage/$name.tmp" | cut -d' ' -f1)" = "$sha" ] || \
      carry_die "reassembled $name's sha256 differs from $sha: re-run prepare and all calls"
    mv "$stage/$name.tmp" "$stage/$name"
  fi
  echo "$carry_prog: $stage/$name: $size bytes, sha256 $sha"
}
