// A device that scores index keys for the Indexer (DESIGN.md 3 and 4.1): it keeps a mirror of the
// host block pool and runs the scan and top-K of a batch of selects. The CUDA backend
// (indexer_service/cuda/cuda_scoring_device.h) is one; the CPU tests use fakes. The host pool stays
// the authoritative copy: a device that fails is dropped and the CPU serves on, losing nothing.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"

namespace dsa {

/// The scoring work of one select: the rows of one (sequence, layer) over a list of its blocks.
struct DeviceScoreJob {
  /// The (sequence, layer) cache, mirrored on the device (every block of its table).
  const KeyCacheView* view = nullptr;
  /// [num_blocks] logical blocks to score, sorted and distinct, each < ceil(view->num_slots / 64).
  std::span<const int32_t> logical_blocks;
  /// [num_rows] rows; queries fp32 [num_heads, head_dim], positions < view->num_slots.
  std::span<const IndexerRow> rows;
  /// K of the sequence (>= 1).
  int top_k = 0;
  /// Out, fp32 [num_rows, num_blocks * 64] in ScoreBlocks' layout (-inf past a row's position), or
  /// empty when the caller needs only the selections.
  std::span<float> scores;
  /// Out, int32 [num_rows, top_k]: SelectTopK's selection of each row over the scored blocks (best
  /// first, ties to the lower slot, -1 padding).
  std::span<int32_t> selections;
};

/// Device time of one ScoreAndSelect, seconds (measured on the device, e.g. by CUDA events), and
/// which scan kernel ran (a static string, e.g. "tensor-cores"; for tests and logs).
struct DeviceScoreSeconds {
  double scan = 0;
  double topk = 0;
  const char* scan_kernel = "";
};

/// Not thread-safe: the Indexer calls it under its mutex.
class ScoringDevice {
 public:
  virtual ~ScoringDevice() = default;

  /// A one-line description for logs, e.g. "cuda:0 NVIDIA H200 (tensor-core scan)".
  virtual std::string Describe() const = 0;

  /// Binds the device to the host pool it mirrors (called once, by Indexer::Create, before any
  /// other call; the pool outlives the device). Allocates the device copy: capacity_blocks x
  /// block_bytes. Errors: RESOURCE_EXHAUSTED (device memory), INTERNAL (other device errors).
  virtual absl::Status Attach(const BlockPool& pool) = 0;

  /// Copies the full bytes of the listed pool blocks from the host pool after a host write
  /// (an append, a copy on write). Blocks may repeat. Returns once the copy is done (the host may
  /// write the blocks again right after). Errors: INTERNAL on a device failure.
  virtual absl::Status MirrorBlocks(std::span<const int32_t> block_ids) = 0;

  /// Scores every job's blocks for its rows and selects each row's top-K, all jobs in one pass.
  /// Scores match ScoreBlocks up to accumulation order (and the query's rounding, when the device
  /// rounds it; see the backend). Errors: UNIMPLEMENTED when a job is outside what the device does
  /// (e.g. K above its largest): the caller scores the batch on the CPU and keeps the device;
  /// INTERNAL on a device failure. Outputs are unspecified on error.
  virtual absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                                      DeviceScoreSeconds* seconds) = 0;
};

}  // namespace dsa
