#!/usr/bin/env bash
# CI check of python/ (the dsa_kernels PyTorch extension) on a machine without torch, CUDA or a GPU:
#   - compiles its torch-free half, python/csrc/kernel_calls.cc (the kernels' Params, CanImplement*
#     and launches), against indexer_service/cuda's headers and the CUDA 13.0 runtime headers of
#     the tools venv (nvidia-cuda-runtime), warnings as errors: a change to a kernel's interface
#     fails here, not in the extension's build on the GPU host;
#   - checks that bindings.cpp (the torch half, built on the GPU host: docs/gpu_kernels.md, "Python
#     module") names no kernel interface itself, so that this compile covers every use of one;
#   - parses the package's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash scripts/python_tools.sh)
site=$("$bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
include=$site/nvidia/cu13/include
if [ ! -f "$include/cuda_runtime_api.h" ]; then
  echo "check_python_kernels: no cuda_runtime_api.h under $include (nvidia-cuda-runtime)" >&2
  exit 1
fi
"${CXX:-g++}" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -I. -isystem "$include" \
  python/csrc/kernel_calls.cc
# at::cuda:: and c10::cuda:: are torch's; any other cuda:: is a kernel interface.
if grep -nE '(^|[^:a-z0-9_])cuda::|dsa::cuda' python/csrc/bindings.cpp; then
  echo "check_python_kernels: bindings.cpp uses the kernels' interfaces directly; call them" \
    "through python/csrc/kernel_calls.h" >&2
  exit 1
fi
"$bin/python" -c 'import ast, sys
for path in sys.argv[1:]:
    ast.parse(open(path, encoding="utf-8").read(), path)' python/dsa_kernels/__init__.py python/setup.py
echo "check_python_kernels: python/csrc/kernel_calls.cc compiles against the kernels' headers"
