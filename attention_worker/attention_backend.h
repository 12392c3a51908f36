// Where an attention worker keeps its KV cache and runs sparse attention over the indexer's
// selections: one interface, a CPU implementation (cpu_attention_backend.h) and a CUDA one
// (attention_worker/cuda/).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/pattern_model.h"

namespace dsa {

/// One decode row to attend at a model layer: its sequence, query position and selection.
struct AttentionRowRef {
  uint64_t sequence_id = 0;
  int64_t position = 0;                // t: the row attends slots <= t
  std::span<const int32_t> selection;  // int32 [K]: the selection of sigma(l), -1 padding
  /// The device-resident path only (then `selection` is empty): the selection int32 [top_k] in
  /// the backend's GPU memory (a DeviceSelectSlot's), read on the backend's stream after its
  /// DeviceStep::WaitForSelections.
  const int32_t* device_selection = nullptr;
  int top_k = 0;  // K of device_selection
};

/// One full layer's device-resident select of a decode step (the co-located path): the indexer's
/// queries generated on the backend's stream, and where the co-located indexer writes the
/// selections (contracts/layer_select.h DeviceSelectBuffers).
struct DeviceSelectSlot {
  const float* queries = nullptr;    // device fp32 [rows, H, D]: PatternModel::IndexerQuery's
  void* queries_ready = nullptr;     // cudaEvent_t, recorded after them on the backend's stream
  int32_t* selections = nullptr;     // device int32 [rows, K], the indexer's to write
  void* selections_ready = nullptr;  // cudaEvent_t, the indexer's to record
};

/// A decode step's device buffers (AttentionBackend::BeginDeviceStep): one DeviceSelectSlot per
/// full layer, reused by later steps once this one is destroyed (after the backend's stream
/// drained: the engine calls AttentionBackend::Synchronize at the step's end). Used by one step
/// at a time.
class DeviceStep {
 public:
  virtual ~DeviceStep() = default;
  /// Generates on the backend's stream the indexer queries of full layer `full_layer` (in [0, the
  /// model's layers)) for one row at each of `positions` (PatternModel::IndexerQuery, bit for bit),
  /// records queries_ready, and sizes the selections for [positions.size(), top_k]. The slot's
  /// buffers stay valid until the step is destroyed. INVALID_ARGUMENT (layer, K, no rows),
  /// RESOURCE_EXHAUSTED (device memory), INTERNAL (a device error).
  virtual absl::StatusOr<DeviceSelectSlot> PrepareSelect(int full_layer,
                                                         std::span<const int64_t> positions,
                                                         int top_k) = 0;
  /// Makes the backend's stream wait, on the GPU, for the slot's selections_ready before any later
  /// work (the host does not wait). Call only after the indexer recorded it
  /// (SelectionTransport::AwaitEnqueued). INVALID_ARGUMENT (no such slot), INTERNAL.
  virtual absl::Status WaitForSelections(int full_layer) = 0;
  /// The step's selects may still run on the indexer (a request abandoned after its deadline): its
  /// buffers are never reused or freed (a leak, so that no late write lands in a later step).
  virtual void Abandon() = 0;
};

/// The KV cache of every model layer for the worker's sequences, and the attention over it.
/// Contents are a pure function of (seed, layer, slot) (the pattern model's KV generator), so a
/// sequence's rows can be regenerated on any backend. Thread-safety: calls for different sequences
/// may run concurrently; the caller serializes calls that touch the same sequence.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  /// "cpu", or the device's description.
  virtual std::string Description() const = 0;

  /// Values of one attended row's output: attention_heads * value_dim.
  virtual int64_t output_values_per_row() const = 0;

  /// The unit slots are held in (the CUDA pool's 64-slot blocks; 1 on the CPU): a sequence of n
  /// slots takes ceil(n / g) * g of the backend's capacity, which is what the engine counts.
  virtual int64_t slot_granularity() const { return 1; }

  /// Sets the slots held for `sequence_id` (created on first use) to `num_slots` in every model
  /// layer: new slots [old, num_slots) get the generator's rows, a shrink drops the newest slots,
  /// 0 forgets the sequence. Errors: RESOURCE_EXHAUSTED (the device's memory; nothing changed).
  virtual absl::Status ResizeSequence(uint64_t sequence_id, int64_t num_slots) = 0;

  /// Attends every row of `rows` at `model_layer` over its selection (DeepSeek Sparse Attention's
  /// core attention over the top-K slots; DESIGN.md 3). With `outputs` non-empty (fp32
  /// [rows.size(), output_values_per_row()]), the outputs are copied there (tests, tools).
  /// Errors: INVALID_ARGUMENT (a selected slot beyond the sequence's slots, an unknown sequence,
  /// output size), INTERNAL (a device error). A device backend may only enqueue the work when no
  /// outputs are asked for: its errors then surface at a later call or at Synchronize.
  virtual absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                                   std::span<float> outputs) = 0;

  /// Waits until every AttendLayer so far has run (a device backend's queue); INTERNAL on a device
  /// error. The engine calls it at the end of each decode step. The default does nothing.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

  // ---- The device-resident path (co-located indexer on the backend's GPU; optional) ----

  /// The CUDA ordinal of the GPU holding DeviceStep buffers, or -1: no device-resident path (the
  /// default, the CPU backend).
  virtual int device_ordinal() const { return -1; }

  /// Readies BeginDeviceStep for `model`'s indexer queries (the CUDA backend uploads its tables,
  /// about 128 MiB plus 0.8 MB a layer). UNIMPLEMENTED without a device path; RESOURCE_EXHAUSTED.
  virtual absl::Status EnableDeviceSelects(const PatternModel& model) {
    return absl::UnimplementedError("this attention backend has no device-resident path");
  }

  /// A step's device buffers. UNIMPLEMENTED unless EnableDeviceSelects succeeded.
  virtual absl::StatusOr<std::unique_ptr<DeviceStep>> BeginDeviceStep() {
    return absl::UnimplementedError("this attention backend has no device-resident path");
  }
};

}  // namespace dsa
