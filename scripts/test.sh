#!/usr/bin/env bash
# The whole test suite: install what is missing, build (CUDA kernels too when nvcc is present),
# run every test with CTest (GoogleTest cases and the real-Prometheus test), check the formatting
# of every C++ and CUDA source, run clang-tidy over the library and tool sources, run each libFuzzer
# harness for 20 s (scripts/fuzz.sh, clang-14 with ASan + UBSan), run the engine and service suites
# under ASan + UBSan in the same instrumented build (scripts/sanitize.sh), then check the
# deployment: the Helm chart, the Prometheus rules and Grafana dashboards, the Dockerfiles, the
# protos (buf lint) and the Python client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
bash scripts/check_format.sh
bash scripts/check_tidy.sh
# libFuzzer (clang-14, ASan + UBSan): each harness 20 s from its seeds (docs/reliability.md).
bash scripts/fuzz.sh 20
# The engine and service suites under ASan + UBSan (docs/reliability.md, "Sanitizers").
bash scripts/sanitize.sh
# Deployment (docs/deploy.md, "What CI checks"): the chart rendered by Helm's engine and validated,
# the rules and dashboards, the images' lint, the protos' lint, the Python client.
bash scripts/check_chart.sh
bash scripts/check_observability.sh
bash scripts/check_images.sh
bash scripts/check_protos.sh
bash scripts/check_client.sh
