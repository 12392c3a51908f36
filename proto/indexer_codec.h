// The wire forms of the indexer API (dsa.indexer.v1, indexer.proto) to and from the contracts'
// plain structs (contracts/layer_select.h, contracts/spin_config.h), both directions in one file:
// the attention worker's gRPC clients encode requests and decode answers, the indexer's gRPC
// adapter decodes requests and encodes answers, so a wire change is made here once.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "contracts/layer_select.h"
#include "contracts/spin_config.h"
#include "dsa/indexer/v1/indexer.pb.h"

namespace dsa {

/// Applies `settings` to `config` (whose fields are the defaults for unset ones): unset mode =
/// SPIN on at the config's rho; all_keep = SPIN off; unset optional fields and UNSPECIFIED enums
/// keep the paper's defaults (SPIN paper section 3; DESIGN.md 4.2). INVALID_ARGUMENT for an
/// unknown enum value (range checks are ValidateSpinConfig's).
absl::Status ToSpinConfig(const dsa::indexer::v1::SpinSettings& settings, SpinConfig* config);

/// The settings that ToSpinConfig turns back into `config` exactly (every field explicit).
dsa::indexer::v1::SpinSettings ToSpinSettings(const SpinConfig& config);

/// Client side. The wire form of one layer's select: one RowGroup per group, fp32 tensors
/// (queries [rows, H, D], head_weights [rows, H], new_index_keys [n, D] when n > 0); request_id
/// left 0. Host buffers only (request.on_device() is the caller's to refuse).
dsa::indexer::v1::SelectRequest EncodeSelectRequest(const LayerSelectRequest& request);

/// Server side. The plain form of `request` for an indexer of `num_heads` x `head_dim`: per group
/// queries fp32, bf16 or fp8 e4m3fn [rows, H, D] (rows >= 1) widened to fp32, head_weights fp32
/// [rows, H], new_index_keys fp32, bf16 or fp8 e4m3fn [n, D] when present. Only the tensors are
/// checked here (every other check is RunLayerSelect's). INVALID_ARGUMENT naming the group ("group
/// g: ...") for no groups, a dtype or a shape.
absl::StatusOr<LayerSelectRequest> DecodeSelectRequest(
    const dsa::indexer::v1::SelectRequest& request, int num_heads, int head_dim);

/// Server side. `response` = request_id and one GroupSelection per group of `selection`, in order:
/// selections int32 [rows, K], blocks scored and visible, all_blocks, audited miss rates.
void EncodeSelectResponse(const LayerSelection& selection, uint64_t request_id,
                          dsa::indexer::v1::SelectResponse* response);

/// Client side. The plain form of an answer to a request whose groups had `group_rows` rows each.
/// INTERNAL when it does not match (group count, a selections tensor that is not int32 [rows, K]).
absl::StatusOr<LayerSelection> DecodeSelectResponse(
    const dsa::indexer::v1::SelectResponse& response, const std::vector<int>& group_rows);

/// Server side, the select stream only: `response` = a refusal of request `request_id` with
/// `status` (not OK) and the number of leading groups applied before it.
void EncodeSelectError(const absl::Status& status, int groups_applied, uint64_t request_id,
                       dsa::indexer::v1::SelectResponse* response);

/// Client side: the status of a refusal, with code and message as sent and the groups applied in
/// the kGroupsAppliedPayload payload; INTERNAL for a code that is OK or not one of gRPC's.
absl::Status DecodeSelectError(const dsa::indexer::v1::SelectError& error, uint64_t request_id);

}  // namespace dsa
