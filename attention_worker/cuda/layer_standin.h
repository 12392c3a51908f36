// The stand-in for the rest of a decode layer on the attention GPU: the
// feed-forward / MoE block, projections and collectives of a DeepSeek-V3.2 layer replaced by a
// real cuBLAS GEMM that reads a configurable number of weight bytes (bf16 weights [N, M] times the
// batch's activations [rows, M]) and an optional fixed busy time (one spinning thread on
// %globaltimer, which holds no bandwidth and one SM). The defaults are calibrated from the MLI
// paper's DeepSeek-V3.2 decode (docs/attention_gpu_inputs.md). Framework-free: pointers, sizes, a
// stream, a cudaError_t back (cuBLAS failures come back as cudaErrorUnknown, with the cuBLAS
// status in LayerStandin::last_cublas_status).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsa::cuda {

/// DeepSeek-V3.2's hidden size: M, the activations' width.
inline constexpr int kStandinHiddenDim = 7168;
/// Default weight rows N: 5302 * 7168 * 2 bytes = 76,009,472 bytes a layer, DeepSeek-V3.2's
/// about 37e9 activated fp8 parameters a token over 61 layers and 8 GPUs (tensor parallel).
inline constexpr int kStandinDefaultWeightRows = 5302;
inline constexpr int64_t kStandinDefaultWeightBytes =
    int64_t{kStandinDefaultWeightRows} * kStandinHiddenDim * 2;
/// Default busy time a layer, microseconds: the calibrated per-layer budget less the GEMM, the
/// indexer and the sparse attention (docs/attention_gpu_inputs.md).
inline constexpr double kStandinDefaultBusyMicros = 84.0;
/// The weights rotate over enough buffers to span at least this many bytes, so the 60 MiB L2 of
/// an H200 never holds the next layer's weights.
inline constexpr int64_t kStandinMinRotationBytes = int64_t{256} << 20;

/// How the weights are stored: they are the same bytes either way; the GEMM reads each layer's
/// buffer once.
enum class StandinWeightLayout : int {
  /// bf16 [N, hidden_dim] row-major (out = activations x W^T; cuBLAS op T on the weights).
  kRowMajorOutputByHidden = 0,
  /// bf16 [hidden_dim, N] row-major (out = activations x W; cuBLAS op N on the weights).
  kRowMajorHiddenByOutput = 1,
};

struct LayerStandinParams {
  /// Weight bytes one layer reads: a positive multiple of 2 * hidden_dim (bf16 [N, hidden_dim]).
  int64_t weight_bytes_per_layer = kStandinDefaultWeightBytes;
  /// M, the activations' width and the GEMM's K (>= 8, a multiple of 8).
  int hidden_dim = kStandinHiddenDim;
  /// Busy time after the GEMM, microseconds (>= 0; 0 launches no spin kernel).
  double busy_micros = kStandinDefaultBusyMicros;
  /// Most activation rows a call may pass (>= 1): sizes nothing here, checked by RunLayerStandin.
  int max_rows = 256;
  /// Seed of the weights' values (uniform in [-1/16, 1/16), bf16).
  uint64_t seed = 0;
  /// Storage of the weights (the faster one on an H200 by default; docs/attention_gpu_inputs.md).
  StandinWeightLayout layout = StandinWeightLayout::kRowMajorOutputByHidden;
};

/// The stand-in's device state. Not thread-safe: one stream at a time.
struct LayerStandin {
  LayerStandinParams params;
  int64_t weight_rows = 0;  // N
  /// Device bf16 [N, hidden_dim] (or [hidden_dim, N], params.layout) each, row-major, all in one
  /// allocation (weights[0]); the layers use them in turn.
  std::vector<__nv_bfloat16*> weights;
  int next_buffer = 0;
  cublasHandle_t cublas = nullptr;
  cublasStatus_t last_cublas_status = CUBLAS_STATUS_SUCCESS;
};

/// Allocates max(2, ceil(kStandinMinRotationBytes / weight_bytes)) weight buffers (one allocation,
/// each buffer 256-byte aligned) on the current device, fills them (synchronously) and creates the
/// cuBLAS handle.
/// cudaErrorInvalidValue for bad params; on error nothing stays allocated.
cudaError_t CreateLayerStandin(const LayerStandinParams& params, LayerStandin* out);
/// Frees everything of CreateLayerStandin (no-op on an empty stand-in).
cudaError_t DestroyLayerStandin(LayerStandin* standin);

/// One layer on `stream` (asynchronous): out = activations x W^T with the next weight buffer
/// (cublasGemmEx, bf16 in and out, fp32 accumulation), then the busy spin.
/// activations: device bf16 [rows, hidden_dim]; out: device bf16 [rows, N]; rows in
/// [1, max_rows]. Returns the buffer index it used through *buffer_used when not null.
cudaError_t RunLayerStandin(LayerStandin* standin, const __nv_bfloat16* activations, int rows,
                            __nv_bfloat16* out, cudaStream_t stream, int* buffer_used = nullptr);

/// Launches only the spin kernel: returns after `micros` of %globaltimer have passed on the device.
cudaError_t LaunchBusySpin(double micros, cudaStream_t stream);

/// What a layer of the stand-in reads and how long it takes (medians over the timed layers).
struct LayerStandinTiming {
  int64_t weight_bytes_per_layer = 0;  // bytes of weights one layer's GEMM reads
  double gemm_micros = 0;              // the GEMM alone
  double layer_micros = 0;             // GEMM + busy spin
  double weight_bytes_per_second = 0;  // weight_bytes_per_layer / gemm time
};

/// Times `iterations` layers (after warm-up) with CUDA events on `stream`, the GEMM alone and the
/// whole layer, each layer on the next weight buffer; synchronizes the stream.
cudaError_t MeasureLayerStandin(LayerStandin* standin, const __nv_bfloat16* activations, int rows,
                                __nv_bfloat16* out, int iterations, cudaStream_t stream,
                                LayerStandinTiming* timing);

}  // namespace dsa::cuda
