// The real model's forward pass on a GPU (docs/model.md; the LlamaRunner of llama_runner.h):
// every weight uploaded once (fp32), each sequence's KV cache contiguous on the GPU (fp32,
// llama_kv_layout.h), the matrices as cuBLAS SGEMMs (loaded at run time: cublas_library.h), and
// the rest as this folder's kernels (llama_kernels.h; gqa_attention.h: the sparse GQA decode over
// each row's selection, the dense causal prefill). The host glue of those kernels: the one place
// their cudaError_t becomes an absl::Status.
//
// Precision: fp32 weights, activations and KV; SGEMM under CUBLAS_DEFAULT_MATH (no TF32);
// softmax and attention in fp32. It equals the CPU runner up to the order of fp32 sums
// (tests/attention_worker/cuda/llama_cuda_runner_test.cc states the tolerances).
//
// Host <-> device per pass: Begin uploads the rows (tokens, positions, RoPE tables); each RunLayer
// uploads its selections (int32, -1 padding); IndexerInputs and Logits copy their results back and
// wait for the stream. Every other call returns with its work queued.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "attention_worker/llama_runner.h"

namespace dsa::cuda {

struct CudaLlamaRunnerOptions {
  int device = 0;  // CUDA ordinal
};

/// Creates the GPU runner on `options.device`: uploads `model`'s weights (4 bytes a parameter:
/// 569 MB for SmolLM2-135M with its indexers), loads cuBLAS, and makes the stream and the memory
/// pool (stream-ordered, kept: freed memory stays reserved for the next pass or cache) that its
/// caches and passes use. Thread-safe as LlamaRunner says: its device work is serialized on one
/// stream under a mutex. Caches and passes must be destroyed before the runner.
/// Errors: INVALID_ARGUMENT (no model, or a shape the kernels are not built for:
/// CanImplementGqaDecode); FAILED_PRECONDITION (no such GPU, not compute capability 9.x, no
/// cuBLAS); RESOURCE_EXHAUSTED (the weights do not fit); INTERNAL (another CUDA or cuBLAS error).
absl::StatusOr<std::shared_ptr<LlamaRunner>> CreateCudaLlamaRunner(
    std::shared_ptr<const LlamaModel> model, const CudaLlamaRunnerOptions& options = {});

/// The number of CUDA devices (0 when the driver or runtime cannot be used): what tests and
/// benchmarks check before they ask for a runner.
int CudaDeviceCount();

}  // namespace dsa::cuda
