// The real model's per-row GPU kernels (see llama_kernels.h).
#include <algorithm>

#include "attention_worker/cuda/llama_kernels.h"

namespace dsa::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `count` items (capped; each thread loops).
unsigned GridFor(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535));
}

__device__ double WarpSum(double value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Sum over the block (every thread gets it); `scratch` holds one double a warp.
__device__ double BlockSum(double value, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  value = WarpSum(value);
  __syncthreads();  // scratch free (a previous BlockSum's readers are done)
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__global__ void EmbeddingGatherKernel(EmbeddingGatherParams p) {
  const int64_t count = static_cast<int64_t>(p.rows) * p.width;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.width, c = i % p.width;
    p.out[i] = p.table[static_cast<int64_t>(p.tokens[r]) * p.width + c];
  }
}

// One warp a row.
__global__ void RmsNormKernel(RmsNormParams p) {
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (i >= p.rows) return;
  const int64_t r = p.row_indices == nullptr ? i : p.row_indices[i];
  const float* x = p.x + r * p.x_stride;
  double sum_squares = 0;
  for (int c = lane; c < p.width; c += 32) sum_squares += static_cast<double>(x[c]) * x[c];
  sum_squares = WarpSum(sum_squares);
  const auto inv = static_cast<float>(1.0 / sqrt(sum_squares / p.width + p.eps));
  float* out = p.out + static_cast<int64_t>(i) * p.out_stride;
  for (int c = lane; c < p.width; c += 32) out[c] = __fmul_rn(x[c], inv) * p.weight[c];
}

// One block a row: rotate every query and key head, then write the key and value to the cache.
__global__ void RopeKvWriteKernel(RopeKvWriteParams p) {
  const int r = blockIdx.x;
  const int pairs = p.head_dim / 2;
  const int q_dim = p.num_heads * p.head_dim, kv_dim = p.num_kv_heads * p.head_dim;
  float* row = p.qkv + static_cast<int64_t>(r) * (q_dim + 2 * kv_dim);
  const float* cos = p.cos + static_cast<int64_t>(r) * pairs;
  const float* sin = p.sin + static_cast<int64_t>(r) * pairs;
  const LlamaRowCache cache = p.caches[r];
  float* keys =
      LlamaLayerKeys(cache.kv_base, cache.capacity, kv_dim, p.layer) + cache.position * kv_dim;
  float* values =
      LlamaLayerValues(cache.kv_base, cache.capacity, kv_dim, p.layer) + cache.position * kv_dim;
  const int rotated_pairs = (p.num_heads + p.num_kv_heads) * pairs;
  for (int i = threadIdx.x; i < rotated_pairs; i += blockDim.x) {
    const int head = i / pairs, j = i % pairs;
    float* x = row + head * p.head_dim + 2 * j;
    const float a = x[0], b = x[1];
    const float c = cos[j], s = sin[j];
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    x[0] = ra;
    x[1] = rb;
    if (head >= p.num_heads) {
      const int k = (head - p.num_heads) * p.head_dim + 2 * j;
      keys[k] = ra;
      keys[k + 1] = rb;
    }
  }
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) values[i] = row[q_dim + kv_dim + i];
}

__global__ void SwiGluKernel(SwiGluParams p) {
  const int64_t count = static_cast<int64_t>(p.rows) * p.ffn_dim;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.ffn_dim, c = i % p.ffn_dim;
    float* g = p.gate_up + r * 2 * p.ffn_dim + c;
    const float gate = *g, up = g[p.ffn_dim];
    *g = __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);
  }
}

// One block a row.
__global__ void IndexerHeadsKernel(IndexerHeadsParams p) {
  __shared__ double scratch[32];
  const int r = blockIdx.x;
  const int h = p.num_heads, dk = p.head_dim, pairs = p.rope_dims / 2;
  const int width = p.query_rank + dk + h;
  const float* proj = p.proj + static_cast<int64_t>(r) * width;
  const float* cos = p.cos + static_cast<int64_t>(r) * pairs;
  const float* sin = p.sin + static_cast<int64_t>(r) * pairs;
  float* queries = p.queries + static_cast<int64_t>(r) * h * dk;
  for (int i = threadIdx.x; i < h * pairs; i += blockDim.x) {
    const int head = i / pairs, j = i % pairs;
    float* x = queries + head * dk + 2 * j;
    const float a = x[0], b = x[1];
    x[0] = __fsub_rn(__fmul_rn(a, cos[j]), __fmul_rn(b, sin[j]));
    x[1] = __fadd_rn(__fmul_rn(a, sin[j]), __fmul_rn(b, cos[j]));
  }
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    p.head_weights[static_cast<int64_t>(r) * h + i] =
        __fmul_rn(proj[p.query_rank + dk + i], p.head_weight_scale);
  }
  // k = RoPE(LayerNorm(Wk x)): mean and variance in double, as the CPU.
  const float* k_raw = proj + p.query_rank;
  double sum = 0;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) sum += k_raw[i];
  const double mean = BlockSum(sum, scratch) / dk;
  double squares = 0;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    squares += (k_raw[i] - mean) * (k_raw[i] - mean);
  }
  const double variance = BlockSum(squares, scratch) / dk;
  const auto inv = static_cast<float>(1.0 / sqrt(variance + p.k_norm_eps));
  const auto mean_f = static_cast<float>(mean);
  float* key = p.index_keys + static_cast<int64_t>(r) * dk;
  const auto normed = [&](int i) {
    return __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(k_raw[i], mean_f), inv), p.k_norm_weight[i]),
                     p.k_norm_bias[i]);
  };
  for (int j = threadIdx.x; j < (dk + 1) / 2; j += blockDim.x) {
    if (j < pairs) {
      const float a = normed(2 * j), b = normed(2 * j + 1);
      key[2 * j] = __fsub_rn(__fmul_rn(a, cos[j]), __fmul_rn(b, sin[j]));
      key[2 * j + 1] = __fadd_rn(__fmul_rn(a, sin[j]), __fmul_rn(b, cos[j]));
    } else {
      key[2 * j] = normed(2 * j);
      if (2 * j + 1 < dk) key[2 * j + 1] = normed(2 * j + 1);
    }
  }
}

}  // namespace

cudaError_t LaunchEmbeddingGather(const EmbeddingGatherParams& p, cudaStream_t stream) {
  if (p.table == nullptr || p.tokens == nullptr || p.out == nullptr || p.rows < 1 || p.width < 1) {
    return cudaErrorInvalidValue;
  }
  EmbeddingGatherKernel<<<GridFor(static_cast<int64_t>(p.rows) * p.width), kThreads, 0, stream>>>(
      p);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr || p.rows < 1 || p.width < 1 ||
      p.x_stride < p.width || p.out_stride < p.width || !(p.eps > 0)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kRowsPerBlock = kThreads / 32;
  RmsNormKernel<<<(p.rows + kRowsPerBlock - 1) / kRowsPerBlock, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchRopeKvWrite(const RopeKvWriteParams& p, cudaStream_t stream) {
  if (p.qkv == nullptr || p.cos == nullptr || p.sin == nullptr || p.caches == nullptr ||
      p.rows < 1 || p.num_heads < 1 || p.num_kv_heads < 1 || p.head_dim < 2 ||
      p.head_dim % 2 != 0 || p.layer < 0) {
    return cudaErrorInvalidValue;
  }
  RopeKvWriteKernel<<<p.rows, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  if (p.gate_up == nullptr || p.rows < 1 || p.ffn_dim < 1) return cudaErrorInvalidValue;
  SwiGluKernel<<<GridFor(static_cast<int64_t>(p.rows) * p.ffn_dim), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchIndexerHeads(const IndexerHeadsParams& p, cudaStream_t stream) {
  if (p.proj == nullptr || p.queries == nullptr || p.head_weights == nullptr ||
      p.index_keys == nullptr || p.k_norm_weight == nullptr || p.k_norm_bias == nullptr ||
      (p.rope_dims > 0 && (p.cos == nullptr || p.sin == nullptr)) || p.rows < 1 ||
      p.num_heads < 1 || p.head_dim < 1 || p.query_rank < 1 || p.rope_dims < 0 ||
      p.rope_dims % 2 != 0 || p.rope_dims > p.head_dim || !(p.k_norm_eps > 0)) {
    return cudaErrorInvalidValue;
  }
  IndexerHeadsKernel<<<p.rows, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
