// The CUDA scoring device of the indexer (`dsa-indexer --device cuda`; DESIGN.md 3 and 4.1): a
// mirror of the host block pool in GPU memory, and one pass per batch of selects that uploads the
// batch (block tables, queries, head weights, positions) in one copy, runs on one stream either
// the whole select with SPIN's EMAs resident on the GPU (select.h: plan, union, scan, top-K, EMA
// update) or, for selects planned on the CPU, the scan (scan.h) and top-K (topk.h), and copies the
// selections (and scores, where asked) back. Implements dsa::ScoringDevice
// (indexer_service/scoring_device.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "indexer_service/scoring_device.h"

namespace dsa::cuda {

/// Which scan kernel the device runs.
enum class ScanKernel {
  /// The tensor-core scan where it applies (num_heads 16, 32 or 64; head_dim 64 or 128), the
  /// CUDA-core scan otherwise.
  kAuto,
  /// Always the tensor-core scan: queries rounded to bf16 (scores as ScoreBlocks on the bf16
  /// query, up to accumulation order). A batch it cannot take is declined (UNIMPLEMENTED: the CPU
  /// scores it).
  kTensorCores,
  /// Always the CUDA-core scan: fp32 queries, scores as ScoreBlocks up to accumulation order.
  kCudaCores,
};

/// Parses "auto" | "tensor-cores" | "cuda-cores"; INVALID_ARGUMENT naming the choices otherwise.
absl::Status ParseScanKernel(const std::string& name, ScanKernel* out);

/// Options of the CUDA scoring device.
struct CudaScoringOptions {
  int device = 0;  // CUDA ordinal
  ScanKernel scan_kernel = ScanKernel::kAuto;
  /// Run SPIN on the GPU too (V and D resident there, the whole select of select.h) for sequences
  /// whose settings it implements: max pooling, A1, random exploration, row-local union, K <=
  /// 2,048. Otherwise (or false) SPIN plans on the CPU and the GPU scans and selects.
  bool spin = true;
};

/// Creates the device on GPU `options.device`. Errors: FAILED_PRECONDITION when no GPU is visible,
/// the ordinal is out of range, or the GPU cannot run the kernels (they are built for sm_90a);
/// INTERNAL for other CUDA errors. Device memory is taken by Attach (the Indexer calls it).
/// The device's ScoreAndSelect declines (UNIMPLEMENTED) a K above kMaxTopK (2,048).
absl::StatusOr<std::unique_ptr<ScoringDevice>> CreateCudaScoringDevice(
    const CudaScoringOptions& options);

}  // namespace dsa::cuda
