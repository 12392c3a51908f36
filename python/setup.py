"""Builds dsa_kernels, the PyTorch extension over the indexer's CUDA kernels (indexer_service/cuda).

The kernel sources are compiled from indexer_service/cuda/ in place (not copied); only the bindings
live in python/csrc/. Build on the GPU host (Python and PyTorch of the machine that runs it), from
this folder:

    MAX_JOBS=16 python3 setup.py build_ext --inplace

(or `python3 -m pip install --no-build-isolation ./python` from the repo root, not yet tried on the
GPU host). Targets sm_90a (Hopper), -O3,
C++17 for nvcc. DSA_REPO_ROOT overrides where the repo root (holding indexer_service/) is found.
"""
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.environ.get("DSA_REPO_ROOT", os.path.join(HERE, "..")))
KERNEL_DIR = os.path.join(ROOT, "indexer_service", "cuda")
KERNELS = ["device_info.cu", "key_append.cu", "scan.cu", "spin_predict.cu", "topk.cu"]

missing = [k for k in KERNELS if not os.path.isfile(os.path.join(KERNEL_DIR, k))]
if missing:
    raise SystemExit(f"dsa_kernels: kernel sources {missing} not found under {KERNEL_DIR}; "
                     "build from a checkout of the repo or set DSA_REPO_ROOT")

# An explicit -gencode keeps torch from adding its own arch flags (it adds none when one is given).
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"]

setup(
    name="dsa_kernels",
    version="0.1.0",
    description="PyTorch bindings of the DSA lightning-indexer CUDA kernels (append, scan, "
                "top-K, SPIN block prediction)",
    packages=["dsa_kernels"],
    ext_modules=[
        CUDAExtension(
            name="dsa_kernels._C",
            sources=[os.path.join(HERE, "csrc", "bindings.cpp"),
                     os.path.join(HERE, "csrc", "kernel_calls.cc")] +
            [os.path.join(KERNEL_DIR, k) for k in KERNELS],
            include_dirs=[ROOT],
            extra_compile_args={"cxx": ["-O3"], "nvcc": NVCC_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
)
