#!/usr/bin/env bash
# The whole test suite: install what is missing, build (CUDA kernels too when nvcc is present),
# run every GoogleTest case with CTest, then check the formatting of every C++ and CUDA source and
# run clang-tidy over the library and tool sources.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
bash scripts/check_format.sh
bash scripts/check_tidy.sh
