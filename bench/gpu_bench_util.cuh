// What the GPU benchmarks share: a CUDA status check that exits, device copies, synthetic keys and
// queries, the device-to-device copy bandwidth (the HBM ceiling of a run) and the median time of a
// launch with the L2 flushed before each run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define DSA_BENCH_CUDA(expr)                                            \
  do {                                                                  \
    const cudaError_t error_ = (expr);                                  \
    if (error_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(error_));                         \
      std::exit(1);                                                     \
    }                                                                   \
  } while (0)

namespace dsa::bench {

/// The items of a comma-separated list ("1x16384,64x65536"), empty items dropped.
inline std::vector<std::string> Split(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    if (end > start) out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

/// A "ROWSxSLOTS" benchmark shape (one row a sequence); a trailing letter is the caller's.
struct Shape {
  int rows = 0;
  int64_t slots = 0;
};
inline Shape ParseShape(const std::string& text) {
  return {std::atoi(text.c_str()), std::atoll(text.c_str() + text.find('x') + 1)};
}

__device__ inline uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

/// Random fp8 keys (codes of magnitude <= 3.75, never NaN) and scales in (0, 1] for every block of
/// a pool of `head_dim` keys (64 x head_dim codes, then 64 fp32 scales a block).
static __global__ void FillPool(uint8_t* pool, int64_t num_blocks, int head_dim) {
  const int64_t block_bytes = 64LL * (head_dim + 4);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < num_blocks * block_bytes;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t offset = i % block_bytes;
    const uint32_t h = Hash(i);
    if (offset < 64 * head_dim) {
      pool[i] = static_cast<uint8_t>((h & 0x80u) | (h % 0x48u));
    } else if (offset % 4 == 0) {
      const float scale = (Hash(i * 7 + 1) % 1000 + 1) * 1e-3f;
      memcpy(pool + i, &scale, 4);
    }
  }
}

/// Random bf16 queries in [-1, 1] ([values]) and head weights in [-1, 1] ([weights]).
static __global__ void FillQuery(__nv_bfloat16* query, int64_t values, float* weights,
                                 int64_t num_weights) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < values;
       i += int64_t{gridDim.x} * blockDim.x) {
    query[i] = __float2bfloat16((Hash(i + 99) % 2001) * 1e-3f - 1.0f);
    if (i < num_weights) weights[i] = (Hash(i + 5) % 2001) * 1e-3f - 1.0f;
  }
}

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* p = nullptr;
  DSA_BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(1, host.size() * sizeof(T))));
  DSA_BENCH_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <typename T>
T* DeviceZeros(size_t count) {
  T* p = nullptr;
  DSA_BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(1, count * sizeof(T))));
  DSA_BENCH_CUDA(cudaMemset(p, 0, std::max<size_t>(1, count * sizeof(T))));
  return p;
}

/// scores[i], i in [0, n): fp32, bell-shaped (the sum of four 16-bit uniforms from a hash of i,
/// in [0, 4), about 2^18 distinct values), or 1.0 everywhere when `equal` (the top-K's worst case).
static __global__ void FillBellScores(float* scores, int64_t n, bool equal) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    float s = 0;
    for (int j = 0; j < 4; ++j) s += static_cast<float>((h >> (16 * j)) & 0xffff) / 65536.0f;
    scores[i] = equal ? 1.0f : s;
  }
}

/// A 256 MiB buffer written before each timed run, so no run finds its data in the 60 MiB L2.
struct L2Flush {
  size_t bytes = size_t{256} << 20;
  void* buffer = nullptr;
  L2Flush() { DSA_BENCH_CUDA(cudaMalloc(&buffer, bytes)); }
  ~L2Flush() { cudaFree(buffer); }
  cudaError_t Run(int salt, cudaStream_t stream) const {
    return cudaMemsetAsync(buffer, salt & 0xff, bytes, stream);
  }
};

/// Nothing to run between the flush and the timed launch.
struct NoPrelude {
  cudaError_t operator()() const { return cudaSuccess; }
};

/// Median time (us) of `launch` on `stream` over `reps` runs after `warmup`, each bracketed by
/// CUDA events with the L2 flushed before it. `prelude` runs after the flush, outside the events
/// (the same kernels on a twin problem's buffers: their code is then in L2 and the timed launch's
/// data is not; see bench_gpu_indexer's *_code_warm figures).
template <typename F, typename P = NoPrelude>
double MedianUs(F launch, const L2Flush& flush, cudaStream_t stream = nullptr, int reps = 30,
                int warmup = 5, P prelude = {}) {
  cudaEvent_t start, stop;
  DSA_BENCH_CUDA(cudaEventCreate(&start));
  DSA_BENCH_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) DSA_BENCH_CUDA(launch());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    DSA_BENCH_CUDA(flush.Run(i, stream));
    DSA_BENCH_CUDA(prelude());
    DSA_BENCH_CUDA(cudaEventRecord(start, stream));
    DSA_BENCH_CUDA(launch());
    DSA_BENCH_CUDA(cudaEventRecord(stop, stream));
    DSA_BENCH_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    DSA_BENCH_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  DSA_BENCH_CUDA(cudaEventDestroy(start));
  DSA_BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

/// A JSON number with two decimals, or null for NaN (not measured).
inline std::string JsonNumber(double value) {
  if (std::isnan(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", value);
  return text;
}

/// Device buffers freed together, after a device synchronization, when the owner goes.
class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    DSA_BENCH_CUDA(cudaDeviceSynchronize());
    for (void* p : buffers_) DSA_BENCH_CUDA(cudaFree(p));
  }
  /// Takes `p` (from cudaMalloc) and returns it.
  template <typename T>
  T* Keep(T* p) {
    buffers_.push_back(const_cast<void*>(static_cast<const void*>(p)));
    return p;
  }

 private:
  std::vector<void*> buffers_;
};

/// The largest problem (rows x slots) that gets a twin for the code-warm figures: past it the
/// code's fetch is a small part of the time and the twin would be a second copy of a large pool.
inline constexpr int64_t kMaxTwinSlots = int64_t{1} << 21;

/// A synthetic pool of `num_blocks` cache blocks of `head_dim` keys (FillPool) and `rows` bf16
/// queries [rows, heads, head_dim] with fp32 head weights [rows, heads] (FillQuery), kept by
/// `buffers`; filled (the device synchronized) on return.
struct SyntheticInputs {
  uint8_t* pool;
  __nv_bfloat16* query;
  float* weights;
};
inline SyntheticInputs MakeSyntheticInputs(DeviceBuffers& buffers, int64_t num_blocks, int rows,
                                           int heads, int head_dim) {
  SyntheticInputs in;
  in.pool = buffers.Keep(DeviceZeros<uint8_t>(num_blocks * 64 * (head_dim + 4)));
  FillPool<<<1024, 256>>>(in.pool, num_blocks, head_dim);
  const int64_t values = int64_t{rows} * heads * head_dim;
  in.query = buffers.Keep(DeviceZeros<__nv_bfloat16>(values));
  in.weights = buffers.Keep(DeviceZeros<float>(int64_t{rows} * heads));
  FillQuery<<<256, 256>>>(in.query, values, in.weights, int64_t{rows} * heads);
  DSA_BENCH_CUDA(cudaGetLastError());
  DSA_BENCH_CUDA(cudaDeviceSynchronize());  // filled before any stream reads them
  return in;
}

/// Device-to-device copy bandwidth (read + write) of a 1 GiB copy, TB/s: the run's HBM ceiling.
inline double CopyBandwidthTBs(const L2Flush& flush) {
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  DSA_BENCH_CUDA(cudaMalloc(&src, bytes));
  DSA_BENCH_CUDA(cudaMalloc(&dst, bytes));
  DSA_BENCH_CUDA(cudaMemset(src, 1, bytes));
  const double us =
      MedianUs([&] { return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); }, flush);
  DSA_BENCH_CUDA(cudaFree(src));
  DSA_BENCH_CUDA(cudaFree(dst));
  return 2.0 * bytes / us * 1e-6;
}

}  // namespace dsa::bench
