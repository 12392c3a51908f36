#!/usr/bin/env bash
# The whole test suite: install what is missing, set up the real model's files, build (CUDA kernels
# too when nvcc is present), run every test with CTest (GoogleTest cases and the real-Prometheus test), check the formatting
# of every C++ and CUDA source, run clang-tidy over the library and tool sources, run each libFuzzer
# harness for 20 s (scripts/fuzz.sh, clang-14 with ASan + UBSan), run every host suite (the
# binaries' too) under ASan + UBSan in the same instrumented build (scripts/sanitize.sh) and the
# engine suites under TSan (scripts/tsan.sh), then check the deployment: the Helm chart, the
# Prometheus rules and Grafana dashboards, the Dockerfiles, the protos (buf lint) and the Python
# client, whose wheel (build/dist/) is the run's artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's duration goes to stderr as it ends, so that CI's log shows where its time goes.
step() {
  local start=$SECONDS
  "$@"
  echo "test.sh: '$*' took $((SECONDS - start)) s (total $SECONDS s)" >&2
}
step bash scripts/bootstrap.sh
# The real model's files (docs/model.md): SmolLM2-135M converted from its GGUF, its tokenizer and
# the Python-docs token splits, into build/models/smollm2-135m (once; later runs check and skip).
step bash scripts/model_setup.sh
step bash scripts/build.sh
step ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
step bash scripts/check_format.sh
step bash scripts/check_tidy.sh
# libFuzzer (clang-14, ASan + UBSan): each harness 20 s from its seeds (docs/reliability.md).
step bash scripts/fuzz.sh 20
# Every host suite under ASan + UBSan, the server binaries built instrumented too
# (docs/reliability.md, "Sanitizers").
step bash scripts/sanitize.sh
# The engine suites under ThreadSanitizer, over Debian's Abseil rebuilt with TSan (the same
# reference, "Sanitizers").
step bash scripts/tsan.sh
# Deployment (docs/deploy.md, "What CI checks"): the chart rendered by Helm's engine and validated,
# the rules and dashboards, the images' lint, the protos' lint, the Python client.
step bash scripts/check_chart.sh
step bash scripts/check_observability.sh
step bash scripts/check_images.sh
step bash scripts/check_protos.sh
step bash scripts/check_client.sh
# python/ (the dsa_kernels extension): its torch-free half compiled against the kernels' headers.
step bash scripts/check_python_kernels.sh
# What a CI run publishes: the Python client's wheel (PEP 517, built out of tree) and its checksum.
echo "test.sh: artifacts: $(ls build/dist/dsa_client-*.whl) build/dist/SHA256SUMS"
