// One layer's select of a decode step, from the contracts' plain structs (contracts/
// layer_select.h) to the Indexer engine and back: what every data plane runs on the indexer
// side (the gRPC stream after decoding its protos, the in-process transport, the NCCL server).
#pragma once

#include <functional>

#include "absl/status/statusor.h"
#include "contracts/layer_select.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"

namespace dsa {

/// Validates and runs `request` against `indexer` (DESIGN.md 4.1-4.2; the contract of
/// dsa.indexer.v1 SelectRequest, indexer.proto):
/// - request.num_heads / head_dim must equal the indexer's H and D; per group queries fp32
///   [num_rows, H, D], head_weights fp32 [num_rows, H], new_index_keys fp32 [n, D] (n >= 0), all
///   finite; num_rows >= 1; row r is at first_position + r.
/// - With n > 0 new keys the rows must end at the layer's newest slot (slot count + n - 1), and no
///   other group may address that (sequence, layer).
/// Every group is checked before anything runs, so such a bad group changes nothing. Then every
/// group's new keys are appended, all or none, and the groups select as one Indexer::SelectBatch.
/// An engine error then changes nothing when the sequences differ; when a sequence has several
/// groups, the groups before the failing one stay applied (their count in `groups_applied`, and
/// the new keys of the others are removed again). The message names the group ("group g: ...").
/// Errors: INVALID_ARGUMENT (no groups, shapes, non-finite values, layer, positions, rows not
/// ending at the newest slot, a layer with new keys in two groups), NOT_FOUND (sequence),
/// OUT_OF_RANGE (a row's key not appended), FAILED_PRECONDITION (a step awaits Commit),
/// RESOURCE_EXHAUSTED (new keys do not fit). `metrics` (optional) records every group that ran.
/// A device-form request (request.on_device(): the co-located path) runs as Indexer::SelectBatch
/// with a DeviceHandoff: the groups carry no host queries (INVALID_ARGUMENT otherwise, or without
/// device selections or K), group g's rows are the device rows after those of groups 0..g-1, and
/// `on_enqueued` is called once the selections are enqueued on the GPU (maybe never, on an error).
/// UNIMPLEMENTED (nothing changed; the new keys removed again) when the indexer cannot take it.
/// Thread-safe (the Indexer serializes).
absl::StatusOr<LayerSelection> RunLayerSelect(Indexer& indexer, const LayerSelectRequest& request,
                                              IndexerMetrics* metrics = nullptr,
                                              int* groups_applied = nullptr,
                                              std::function<void()> on_enqueued = nullptr);

}  // namespace dsa
