// cuBLAS loaded at run time (dlopen of libcublas.so.13), so that a binary linking the real model's
// GPU runner does not load cuBLAS at start: libcublasLt's 94 KB of TLS would then sit in every
// thread's static TLS block, which Debian civetweb's 100 KB thread stacks (the /metrics server)
// cannot hold (standin_module.h). Loaded with dlopen, before or after the server starts, its TLS is
// allocated on first use by each thread instead. Framework-free.
#pragma once

#include <cublas_v2.h>

#include <string>

namespace dsa::cuda {

/// The cuBLAS entry points the runner uses (the names cublas_v2.h maps to).
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

/// Loads cuBLAS once per process (libcublas.so.13, libcublas.so, then CUDA's default folder;
/// the module stays loaded).
/// Thread-safe. Returns null when it cannot, with dlerror's text in *error (if given).
const CublasApi* LoadCublas(std::string* error);

}  // namespace dsa::cuda
