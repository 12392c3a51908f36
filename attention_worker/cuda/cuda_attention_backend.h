// The CUDA attention backend (dsa-attention --attention-device cuda): the KV cache of every model
// layer on the GPU in DeepSeek-V3.2's MLA decode shape (paged 64-slot blocks of 576-dim bf16
// latent rows, generated on the device from the seed: MlaKvRow), and each layer's sparse attention
// over the indexer's selections by the tensor-core sparse MLA decode (sparse_mla_decode.h), all on
// one stream that the host does not wait for between layers. The co-located device-resident path
// (AttentionBackend::BeginDeviceStep): the indexer queries generated on the GPU
// (pattern_inputs.h) and device selections attended in place after an event wait. The host glue
// of those kernels: the only place their cudaError_t becomes an absl::Status. The rest of the
// layer (layer_standin.h) is not linked here: it needs cuBLAS, which a server with /metrics cannot
// load at start (attention_worker/cuda/CMakeLists.txt says why); the benches pass it as
// rest_of_layer, and dsa-attention --layer-standin passes the module it loads later
// (standin_loader.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "attention_worker/attention_backend.h"

namespace dsa::cuda {

struct CudaAttentionBackendOptions {
  int device = 0;            // CUDA ordinal
  int num_model_layers = 1;  // >= 1
  int num_heads = 128;       // attention query heads, a multiple of 64
  uint64_t seed = 0;         // of MlaKvRow and MlaAttentionQuery
  /// KV slots over all sequences (every model layer holds this many): the pool is
  /// ceil(capacity / 64) blocks a layer of 64 x 576 bf16 (73,728 bytes), allocated at creation.
  int64_t capacity_slots = int64_t{1} << 20;
  /// Optional: the rest of each layer, enqueued on the backend's stream right after the layer's
  /// attention (so it runs in stream order, with no host wait): called with the stream (a
  /// cudaStream_t) and the layer's row count; an error ends AttendLayer with INTERNAL. The benches
  /// pass the cuBLAS stand-in (layer_standin.h) here, which a server cannot load.
  std::function<cudaError_t(void* stream, int num_rows)> rest_of_layer;
};

/// Creates the backend on `options.device`: the pools and the block tables' staging.
/// Errors: INVALID_ARGUMENT (a field out of range), FAILED_PRECONDITION (no such GPU, or one the
/// kernels cannot run on: they need sm_90a), RESOURCE_EXHAUSTED (the pools do not fit).
/// Outputs fp32 [num_heads, 512] a row (copied back only when asked). Thread-safe as the
/// interface says (one stream; calls serialize on a mutex).
absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaAttentionBackend(
    const CudaAttentionBackendOptions& options);

}  // namespace dsa::cuda
