#!/usr/bin/env bash
# Sourced by scripts/fuzz.sh and scripts/fuzz_long.sh: prepare_corpus NAME BUILD makes the corpus
# and artifact folders of harness NAME under BUILD (corpus/NAME, artifacts/NAME), copies its seeds
# (fuzz/seeds/<NAME without fuzz_>/) into the corpus, text-format protobuf seeds (*.txtpb) encoded
# with protoc, and exports DSA_FUZZ_SEED_DIR (the RPC-handler harnesses write their seeds,
# frames of serialized calls, there at start-up). Run from the repository root.
prepare_corpus() {
  local name=$1 build=$2
  local seeds=fuzz/seeds/${name#fuzz_}
  local corpus=$build/corpus/$name
  mkdir -p "$corpus" "$build/artifacts/$name"
  export DSA_FUZZ_SEED_DIR=$corpus
  local seed
  for seed in "$seeds"/*; do
    [ -e "$seed" ] || continue
    case $seed in
      *.txtpb)
        protoc -I proto --encode=dsa.common.v1.Tensor dsa/common/v1/tensor.proto \
          <"$seed" >"$corpus/$(basename "$seed" .txtpb).bin"
        ;;
      *) cp "$seed" "$corpus/" ;;
    esac
  done
}
