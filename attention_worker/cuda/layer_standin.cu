// The stand-in for the rest of a decode layer (see layer_standin.h).
#include <algorithm>
#include <cmath>

#include "attention_worker/cuda/layer_standin.h"
#include "attention_worker/cuda/uniform_row.h"

namespace dsa::cuda {
namespace {

constexpr int kFillThreads = 256;

// Weight element i of buffer b: (2u - 1) / 16, u uniform (Philox of (seed, b, i / 4)).
__global__ void FillWeightsKernel(__nv_bfloat16* weights, int64_t count, uint64_t seed,
                                  int buffer) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (4 * group >= count) return;
  const PhiloxCounter words = UniformRowBlock(seed, 0x7Fu, buffer, group, 0u);
  for (int k = 0; k < 4 && 4 * group + k < count; ++k) {
    weights[4 * group + k] = __float2bfloat16_rn(UniformRowValue(words.c[k]) * 0.0625f);
  }
}

__global__ void BusySpinKernel(uint64_t nanoseconds) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

cudaError_t FromCublas(LayerStandin* standin, cublasStatus_t status) {
  standin->last_cublas_status = status;
  return status == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

double Median(std::vector<float> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

cudaError_t CreateLayerStandin(const LayerStandinParams& params, LayerStandin* out) {
  if (out == nullptr || params.hidden_dim < 8 || params.hidden_dim % 8 != 0 ||
      params.weight_bytes_per_layer <= 0 ||
      params.weight_bytes_per_layer % (2 * int64_t{params.hidden_dim}) != 0 ||
      !(params.busy_micros >= 0.0) || params.max_rows < 1) {
    return cudaErrorInvalidValue;
  }
  LayerStandin s;
  s.params = params;
  s.weight_rows = params.weight_bytes_per_layer / (2 * int64_t{params.hidden_dim});
  if (s.weight_rows > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t wanted = (kStandinMinRotationBytes + params.weight_bytes_per_layer - 1) /
                         params.weight_bytes_per_layer;
  const int64_t buffers = std::max<int64_t>(2, wanted);
  const int64_t stride = (params.weight_bytes_per_layer + 255) / 256 * 256;
  const int64_t count = s.weight_rows * params.hidden_dim;
  void* base = nullptr;
  cudaError_t err = cudaMalloc(&base, static_cast<size_t>(buffers * stride));
  if (err != cudaSuccess) return err;
  for (int64_t b = 0; b < buffers && err == cudaSuccess; ++b) {
    s.weights.push_back(reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(base) + b * stride));
    const int64_t groups = (count + 3) / 4;
    FillWeightsKernel<<<static_cast<unsigned>((groups + kFillThreads - 1) / kFillThreads),
                        kFillThreads>>>(s.weights.back(), count, params.seed, static_cast<int>(b));
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess && cublasCreate(&s.cublas) != CUBLAS_STATUS_SUCCESS) {
    s.cublas = nullptr;
    err = cudaErrorUnknown;
  }
  if (err != cudaSuccess) {
    DestroyLayerStandin(&s);
    return err;
  }
  *out = s;
  return cudaSuccess;
}

cudaError_t DestroyLayerStandin(LayerStandin* standin) {
  if (standin == nullptr) return cudaSuccess;
  const cudaError_t first = standin->weights.empty() ? cudaSuccess : cudaFree(standin->weights[0]);
  if (standin->cublas != nullptr) cublasDestroy(standin->cublas);
  *standin = LayerStandin{};
  return first;
}

cudaError_t LaunchBusySpin(double micros, cudaStream_t stream) {
  if (!(micros >= 0.0)) return cudaErrorInvalidValue;
  if (micros == 0.0) return cudaSuccess;
  BusySpinKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(std::llround(micros * 1000.0)));
  return cudaGetLastError();
}

cudaError_t RunLayerStandin(LayerStandin* standin, const __nv_bfloat16* activations, int rows,
                            __nv_bfloat16* out, cudaStream_t stream, int* buffer_used) {
  if (standin == nullptr || standin->cublas == nullptr || standin->weights.empty() ||
      activations == nullptr || out == nullptr || rows < 1 || rows > standin->params.max_rows) {
    return cudaErrorInvalidValue;
  }
  const int buffer = standin->next_buffer;
  standin->next_buffer = (buffer + 1) % static_cast<int>(standin->weights.size());
  if (buffer_used != nullptr) *buffer_used = buffer;
  cublasStatus_t status = cublasSetStream(standin->cublas, stream);
  if (status != CUBLAS_STATUS_SUCCESS) return FromCublas(standin, status);
  // Row-major out[rows, N] = activations[rows, M] x W[N, M]^T is, column-major,
  // out^T[N, rows] = W^T^T[N, M] x activations^T[M, rows].
  const float alpha = 1.0f, beta = 0.0f;
  const int n = static_cast<int>(standin->weight_rows), m = standin->params.hidden_dim;
  // With W stored [M, N] row-major (column-major [N, M], leading dimension N) it is op N.
  const bool by_hidden = standin->params.layout == StandinWeightLayout::kRowMajorOutputByHidden;
  status = cublasGemmEx(standin->cublas, by_hidden ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, n,
                        rows, m, &alpha, standin->weights[buffer], CUDA_R_16BF, by_hidden ? m : n,
                        activations, CUDA_R_16BF, m, &beta, out, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) return FromCublas(standin, status);
  return LaunchBusySpin(standin->params.busy_micros, stream);
}

cudaError_t MeasureLayerStandin(LayerStandin* standin, const __nv_bfloat16* activations, int rows,
                                __nv_bfloat16* out, int iterations, cudaStream_t stream,
                                LayerStandinTiming* timing) {
  if (standin == nullptr || timing == nullptr || iterations < 1) return cudaErrorInvalidValue;
  cudaEvent_t start, stop;
  cudaError_t err = cudaEventCreate(&start);
  if (err != cudaSuccess) return err;
  err = cudaEventCreate(&stop);
  if (err != cudaSuccess) {
    cudaEventDestroy(start);
    return err;
  }
  const double busy = standin->params.busy_micros;
  std::vector<float> gemm_ms, layer_ms;
  for (int pass = 0; pass < 2 && err == cudaSuccess; ++pass) {
    standin->params.busy_micros = pass == 0 ? 0.0 : busy;
    std::vector<float>& times = pass == 0 ? gemm_ms : layer_ms;
    for (int i = -3; i < iterations && err == cudaSuccess; ++i) {  // 3 warm-up layers
      err = cudaEventRecord(start, stream);
      if (err == cudaSuccess) err = RunLayerStandin(standin, activations, rows, out, stream);
      if (err == cudaSuccess) err = cudaEventRecord(stop, stream);
      if (err == cudaSuccess) err = cudaEventSynchronize(stop);
      float ms = 0.0f;
      if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start, stop);
      if (err == cudaSuccess && i >= 0) times.push_back(ms);
    }
  }
  standin->params.busy_micros = busy;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (err != cudaSuccess) return err;
  timing->weight_bytes_per_layer = standin->params.weight_bytes_per_layer;
  timing->gemm_micros = Median(gemm_ms) * 1000.0;
  timing->layer_micros = Median(layer_ms) * 1000.0;
  timing->weight_bytes_per_second =
      timing->gemm_micros > 0.0
          ? static_cast<double>(timing->weight_bytes_per_layer) / (timing->gemm_micros * 1e-6)
          : 0.0;
  return cudaSuccess;
}

}  // namespace dsa::cuda
