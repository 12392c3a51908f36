// Staging of device-resident indexer queries (see query_stage.h).
#include <cuda_bf16.h>

#include "indexer_service/cuda/query_stage.h"

namespace dsa::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void StageQueriesKernel(const float* const* row_queries, int64_t values_per_row,
                                   bool to_bfloat16, void* out) {
  const int64_t row = blockIdx.y;
  const float* source = row_queries[row];
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < values_per_row;
       i += int64_t{gridDim.x} * kThreads) {
    const float value = source[i];
    if (to_bfloat16) {
      static_cast<__nv_bfloat16*>(out)[row * values_per_row + i] = __float2bfloat16_rn(value);
    } else {
      static_cast<float*>(out)[row * values_per_row + i] = value;
    }
  }
}

}  // namespace

cudaError_t LaunchStageQueries(const StageQueriesParams& params, cudaStream_t stream) {
  if (params.num_rows < 0 || params.num_rows > 65535 || params.values_per_row < 1) {
    return cudaErrorInvalidValue;
  }
  if (params.num_rows == 0) return cudaSuccess;
  if (params.row_queries == nullptr || params.out == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks_x = (params.values_per_row + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(blocks_x < 64 ? blocks_x : 64),
                  static_cast<unsigned>(params.num_rows));
  StageQueriesKernel<<<grid, kThreads, 0, stream>>>(params.row_queries, params.values_per_row,
                                                    params.to_bfloat16, params.out);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
