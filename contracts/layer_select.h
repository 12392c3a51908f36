// The select of one full layer as plain structs (DESIGN.md 4.1): what the attention worker asks of
// the indexer and what it gets back, the same for every data plane (gRPC stream, in-process, NCCL)
// and for the indexer engine's entry point (indexer_service/layer_select.h). No protos: the wire
// forms are proto/select_codec.h's and transport/nccl_wire.h's.
#pragma once

#include <cstdint>
#include <vector>

namespace dsa {

/// Payload (absl::Status::SetPayload) of a refused request's status from Await: the decimal number
/// of leading groups the indexer applied before refusing it (SelectError.groups_applied on the
/// wire; Indexer::SelectBatch's groups_applied in process).
inline constexpr char kGroupsAppliedPayload[] = "type.dsa/indexer.v1.SelectError.groups_applied";

/// One row group of a layer's select: the decode rows of one sequence at one full layer, with the
/// new index keys of the step (DESIGN.md 4.1; the indexer appends them before the rows select).
/// Host buffers, fp32, row-major; H and D are the LayerSelectRequest's.
struct SelectRowGroup {
  uint64_t sequence_id = 0;
  /// Full-layer index on the indexer (0 .. num_full_layers - 1), not a model layer.
  int layer = 0;
  /// Query position t of row 0; row r is at t + r (verifier rows are consecutive).
  int64_t first_position = 0;
  /// Rows, >= 1 (1 = a plain decode step; d + 1 = speculative verifier rows).
  int num_rows = 0;
  /// Indexer queries, fp32 [num_rows, H, D].
  std::vector<float> queries;
  /// Head weights (query scale folded in), fp32 [num_rows, H].
  std::vector<float> head_weights;
  /// The step's new index keys, fp32 [num_new_keys, D] (num_new_keys = size / D, may be 0); with
  /// keys the rows must end at the layer's newest slot after the append.
  std::vector<float> new_index_keys;
};

/// The device-resident form of a request (the co-located path on one GPU;
/// only for a transport whose device_ordinal() >= 0, the in-process one): the queries are already
/// on that GPU and the selections stay there; a stream of the attention worker waits on
/// `selections_ready` before reading them, the host never does. Head weights and new index keys
/// stay host buffers (H and D floats a row; the new keys go to the host cache, the authoritative
/// copy). The groups' `queries` are empty then.
struct DeviceSelectBuffers {
  /// Device fp32 [total rows of the request, H, D] on the transport's GPU, rows in group order.
  const float* queries = nullptr;
  /// cudaEvent_t, as void*: recorded after `queries` were written (null: already written).
  void* queries_ready = nullptr;
  /// Device int32 out [total rows, top_k], rows in group order; valid once `selections_ready`
  /// completes. The caller owns it (and `queries`) and keeps both until the answer is awaited; a
  /// forgotten request may still run later and read and write them, so after Forget they are
  /// never reused (the engine leaks its step's buffers then: DeviceStep::Abandon).
  int32_t* selections = nullptr;
  /// K of every group's sequence (the row stride of `selections`), >= 1.
  int top_k = 0;
  /// cudaEvent_t, as void*: the indexer records it on its stream after writing `selections`.
  void* selections_ready = nullptr;
};

/// The indexer inputs of one full layer for every sequence of a decode step on one indexer worker
/// (one request, one scoring pass on the indexer).
struct LayerSelectRequest {
  int num_heads = 0;  // H of the indexer query, >= 1
  int head_dim = 0;   // D of queries and index keys, >= 1
  std::vector<SelectRowGroup> groups;
  /// The device-resident form (device.queries != null), or host buffers only.
  DeviceSelectBuffers device;
  bool on_device() const { return device.queries != nullptr; }
};

/// The answer for one row group.
struct GroupSelection {
  int num_rows = 0;
  int top_k = 0;  // K
  /// int32 [num_rows, top_k]: slots best first, -1 padding (DESIGN.md 4.1).
  std::vector<int32_t> selections;
  int64_t blocks_scored = 0;   // blocks the indexer scored for the group
  int64_t blocks_visible = 0;  // ceil(N_t / 64) of the last row
  bool all_blocks = false;     // every visible block was scored (all-keep, warm-up, N_t <= K)
  /// Per row, the audited miss rate (empty when the indexer did not audit the group).
  std::vector<double> audit_miss_rates;
};

/// The answer to one LayerSelectRequest: one GroupSelection per request group, in order.
struct LayerSelection {
  std::vector<GroupSelection> groups;
};

}  // namespace dsa
