// A device that scores index keys for the Indexer (DESIGN.md 3 and 4.1): it keeps a mirror of the
// host block pool and runs the scan and top-K of a batch of selects. The CUDA backend
// (indexer_service/cuda/cuda_scoring_device.h) is one; the CPU tests use fakes. The host pool stays
// the authoritative copy: a device that fails is dropped and the CPU serves on, losing nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"
#include "indexer_service/spin.h"

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

/// A batch of selects whose indexer queries are already in the scoring device's memory and whose
/// selections stay there (the co-located, device-resident path: the MLI
/// paper's deferred stream). The producer (the attention worker, same GPU) records `inputs_ready`
/// on its stream after writing the queries; the device's stream waits on it, runs the select,
/// writes each job's selections to DeviceSpinJob::device_selections, records `selections_ready`
/// and calls `on_enqueued`; a consumer stream waits on `selections_ready` (not on the host) before
/// reading them. The host still gets the selections and blocks (the Indexer's bookkeeping).
struct DeviceHandoff {
  /// K of every select of the batch (the row stride of device_selections); the Indexer refuses a
  /// group whose sequence has another K.
  int top_k = 0;
  /// cudaEvent_t, as void*: the queries are written once it completes (null: nothing to wait on).
  void* inputs_ready = nullptr;
  /// cudaEvent_t, as void*: recorded on the device's stream after every job's device_selections.
  void* selections_ready = nullptr;
  /// Called once, on the calling thread, as soon as `selections_ready` is recorded (before the
  /// device waits for its own results): a consumer may enqueue its wait from then on. Optional.
  std::function<void()> on_enqueued;
};

/// One select whose SPIN runs on the device (ScoringDevice::SelectWithSpin): the EMAs V and D of
/// (sequence, layer) live there; the device plans (DESIGN.md 4.2 steps 1-6), scores, selects and
/// updates (step 8).
struct DeviceSpinJob {
  /// The (sequence, layer) cache: its block table and filled slots.
  const KeyCacheView* view = nullptr;
  /// The EMAs' owner on the device: (sequence_id, layer).
  uint64_t sequence_id = 0;
  int layer = 0;
  /// One row (a decode step) or verifier rows t..t+d (consecutive positions, the last one the
  /// view's last filled slot; their update waits for CommitSpin).
  std::span<const IndexerRow> rows;
  /// The sequence's SPIN settings, the seed already mixed with the sequence id (as SpinState
  /// holds it); the device accepted them (RunsSpin).
  const SpinConfig* config = nullptr;
  int top_k = 0;  // K
  /// Every visible block (the warm-up select of a turn, or SPIN off) instead of SPIN's plan.
  bool all_blocks = false;
  /// Out: the scored logical blocks, ascending (SpinState::Plan's `blocks`).
  std::vector<int32_t>* blocks = nullptr;
  /// Optional out (null = not wanted): fp32 [num_rows, blocks->size() * 64], ScoreBlocks' layout.
  std::vector<float>* scores = nullptr;
  /// Out, int32 [num_rows, top_k]: each row's selection over the scored blocks.
  std::span<int32_t> selections;
  /// The device-resident path (null otherwise; the same for every job of the call): the rows'
  /// queries are IndexerRow::device_query, and the selections also go to `device_selections`.
  const DeviceHandoff* handoff = nullptr;
  /// With `handoff`: out, device int32 [num_rows, top_k], written on the device's stream before
  /// handoff->selections_ready.
  int32_t* device_selections = nullptr;
};

/// Not thread-safe: the Indexer calls it under its mutex.
class ScoringDevice {
 public:
  virtual ~ScoringDevice() = default;

  /// A one-line description for logs, e.g. "cuda:0 NVIDIA H200 (tensor-core scan)".
  virtual std::string Describe() const = 0;

  /// The CUDA ordinal whose memory DeviceSpinJob's device pointers address (the device-resident
  /// path, DeviceHandoff), or -1 when the device takes host queries only (the default).
  virtual int device_ordinal() const { return -1; }

  /// Binds the device to the host pool it mirrors and the queries' head count H (called once, by
  /// Indexer::Create, before any other call; the pool outlives the device). Allocates the device
  /// copy: capacity_blocks x block_bytes. Errors: RESOURCE_EXHAUSTED (device memory),
  /// FAILED_PRECONDITION (a shape the device was configured for but cannot run), INTERNAL (other
  /// device errors).
  virtual absl::Status Attach(const BlockPool& pool, int num_heads) = 0;

  /// Copies the full bytes of the listed pool blocks from the host pool after a host write
  /// (an append, a copy on write). Block ids in [0, the pool's capacity_blocks); they may repeat.
  /// Returns once the copy is done (the host may write the blocks again right after). Errors:
  /// INTERNAL on a device failure.
  virtual absl::Status MirrorBlocks(std::span<const int32_t> block_ids) = 0;

  /// Scores every job's blocks for its rows and selects each row's top-K, all jobs in one pass.
  /// Scores match ScoreBlocks up to accumulation order (and the query's rounding, when the device
  /// rounds it; see the backend). Errors: UNIMPLEMENTED when a job is outside what the device does
  /// (e.g. K above its largest), RESOURCE_EXHAUSTED when its scratch memory cannot grow: for both
  /// the caller scores the batch on the CPU and keeps the device; INTERNAL on a device failure.
  /// Outputs are unspecified on error.
  virtual absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                                      DeviceScoreSeconds* seconds) = 0;

  // ---- SPIN on the device (optional; the defaults run none) ----

  /// Whether SelectWithSpin takes sequences with this SPIN configuration and K. The Indexer asks
  /// once a sequence, at its creation.
  virtual bool RunsSpin(const SpinConfig& config, int top_k) const { return false; }

  /// The whole select of every job on the device: plan (or every block), scan, top-K, and for a
  /// job of one row the EMA update; the scores of verifier rows stay on the device until
  /// CommitSpin. Jobs with a DeviceHandoff (only on a device with device_ordinal() >= 0) read
  /// device queries and write device selections as DeviceHandoff says. A (sequence, layer) never
  /// seen before starts with zero EMAs. Errors: RESOURCE_EXHAUSTED when its memory cannot grow,
  /// INTERNAL on a device failure; the Indexer drops the device on either (the EMAs kept there are
  /// then lost) and plans these selects again on the CPU. Outputs unspecified on error.
  virtual absl::Status SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                                      DeviceScoreSeconds* seconds) {
    return absl::UnimplementedError("this scoring device does not run SPIN");
  }

  /// Ends the pending verifier step of (sequence, layer): its rows 0 .. replay_rows - 1 replayed
  /// into the EMAs in order (SpinState::Update each), then the step dropped (replay_rows 0: only
  /// dropped). Errors: FAILED_PRECONDITION (no pending step), INTERNAL (device failure).
  virtual absl::Status CommitSpin(uint64_t sequence_id, int layer, int replay_rows) {
    return absl::UnimplementedError("this scoring device does not run SPIN");
  }

  /// Zeroes the EMAs of every layer of the sequence (a new turn). Errors: INTERNAL.
  virtual absl::Status ResetSpin(uint64_t sequence_id) {
    return absl::UnimplementedError("this scoring device does not run SPIN");
  }

  /// Frees the sequence's SPIN state on the device (nothing when it has none).
  virtual void ReleaseSpin(uint64_t sequence_id) {}

  /// Copies V and D of (sequence, layer) to the host, each as long as the device keeps them (zeros
  /// past what SPIN wrote). Errors: NOT_FOUND (no state), INTERNAL.
  virtual absl::Status ReadSpin(uint64_t sequence_id, int layer, std::vector<float>* vertical,
                                std::vector<float>* diagonal) {
    return absl::UnimplementedError("this scoring device does not run SPIN");
  }
};

}  // namespace dsa
