// OpenBLAS for the real model's CPU forward, shared by its loading (llama_model.cc) and its
// passes (llama_forward.cc); internal to dsa_llama, whose target alone sees cblas.h.
#pragma once

#include <cblas.h>  // declarations only: OpenBLAS is loaded with dlopen (Blas() below)

#include "absl/status/statusor.h"

namespace dsa {

// The OpenBLAS functions the model calls.
struct BlasFunctions {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_sgemv) sgemv = nullptr;
};

// OpenBLAS, loaded once (thread-safe) by the first model built or IndexScores call, and never
// unloaded. It is dlopened, not linked: a linked libopenblas.so.0 is in every startup link map, and
// its 60 KB of TLS then lands in every thread's static TLS block, which glibc takes out of each
// thread's stack. Debian civetweb's /metrics threads ask for 100 KB and kept 12 KB (with CUDA's
// libraries); serving a scrape overflowed that, jumping the guard page into the civetweb master
// thread's descriptor, and dsa-attention died with SIGSEGV (cuda/standin_module.h: the same with
// cuBLAS). Loaded later, the library's TLS (the general-dynamic model) is allocated on first use,
// by the threads that call it. With OpenBLAS's pthread build, its own threads would compete with
// the model's OpenMP threads: it is set to one thread. (The OpenMP build runs single-threaded
// inside a parallel region by itself, and its openblas_set_num_threads would change OpenMP's
// thread count: left alone.)
const absl::StatusOr<BlasFunctions>& Blas();

}  // namespace dsa
