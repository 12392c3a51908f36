// Staging of device-resident indexer queries (the co-located path, scoring_device.h
// DeviceHandoff): the rows' fp32 queries, wherever the producer wrote them on this GPU, gathered
// into the select's query buffer, rounded to bf16 for the tensor-core scan (round to nearest
// even, as the host upload's ToBfloat16) or copied as fp32 for the CUDA-core scan. Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

struct StageQueriesParams {
  /// Device array [num_rows] of device pointers, each to fp32 [values_per_row] (finite values).
  const float* const* row_queries = nullptr;
  int64_t num_rows = 0;        // >= 0 (0 launches nothing)
  int64_t values_per_row = 0;  // H x D, >= 1
  bool to_bfloat16 = true;     // bf16 out (tensor-core scan) or fp32 out (CUDA-core scan)
  /// Device out [num_rows, values_per_row], bf16 or fp32 as to_bfloat16 says.
  void* out = nullptr;
};

/// Asynchronous on `stream`; cudaErrorInvalidValue for null pointers or sizes out of range, else
/// the launch error.
cudaError_t LaunchStageQueries(const StageQueriesParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
