// The wire forms of the indexer API (dsa.indexer.v1, indexer.proto) to and from the contracts'
// plain structs, both directions in one place: what the attention worker's gRPC clients encode is
// what the indexer's gRPC adapter decodes, and back.
#include "proto/indexer_codec.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/tensor_codec.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::indexer::v1;

// The tensors of one group decoded into the plain struct (every other check is
// RunLayerSelect's).
absl::Status DecodeGroup(const v1::RowGroup& group, size_t index, int64_t num_heads,
                         int64_t head_dim, SelectRowGroup* decoded) {
  const std::string prefix = absl::StrCat("group ", index, ": ");
  const int64_t query_shape[] = {-1, num_heads, head_dim};
  DSA_ASSIGN_OR_RETURN(decoded->queries,
                       DecodeFloatTensor(group.queries(), query_shape, prefix + "queries"));
  const int64_t num_rows = group.queries().shape(0);
  if (num_rows < 1) return absl::InvalidArgumentError(prefix + "queries have no rows");
  if (group.head_weights().dtype() != dsa::common::v1::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "head_weights must be DTYPE_FLOAT32, got ",
                     dsa::common::v1::DType_Name(group.head_weights().dtype())));
  }
  const int64_t weight_shape[] = {num_rows, num_heads};
  DSA_ASSIGN_OR_RETURN(decoded->head_weights, DecodeFloatTensor(group.head_weights(), weight_shape,
                                                                prefix + "head_weights"));
  if (group.has_new_index_keys()) {
    const int64_t key_shape[] = {-1, head_dim};
    DSA_ASSIGN_OR_RETURN(
        decoded->new_index_keys,
        DecodeFloatTensor(group.new_index_keys(), key_shape, prefix + "new_index_keys"));
  }
  decoded->sequence_id = group.sequence_id();
  decoded->layer = group.layer();
  decoded->first_position = group.first_position();
  decoded->num_rows = static_cast<int>(num_rows);
  return absl::OkStatus();
}

}  // namespace

absl::Status ToSpinConfig(const v1::SpinSettings& settings, SpinConfig* config) {
  switch (settings.mode_case()) {
    case v1::SpinSettings::kAllKeep:
      config->enabled = !settings.all_keep();
      break;
    case v1::SpinSettings::kTargetBlockSparsity:
      config->target_block_sparsity = settings.target_block_sparsity();
      break;
    case v1::SpinSettings::MODE_NOT_SET:
      break;
  }
  if (settings.has_ema_decay()) config->ema_decay = settings.ema_decay();
  if (settings.has_exploration_fraction()) {
    config->exploration_fraction = settings.exploration_fraction();
  }
  switch (settings.pooling()) {
    case v1::BLOCK_POOLING_UNSPECIFIED:
    case v1::BLOCK_POOLING_MAX:
      config->pooling = BlockPooling::kMax;
      break;
    case v1::BLOCK_POOLING_TOP4_MEAN:
      config->pooling = BlockPooling::kTop4Mean;
      break;
    case v1::BLOCK_POOLING_MEAN:
      config->pooling = BlockPooling::kMean;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown pooling ", settings.pooling()));
  }
  switch (settings.reduction()) {
    case v1::BLOCK_REDUCTION_UNSPECIFIED:
    case v1::BLOCK_REDUCTION_A1:
      config->reduction = BlockReduction::kA1;
      break;
    case v1::BLOCK_REDUCTION_A0:
      config->reduction = BlockReduction::kA0;
      break;
    case v1::BLOCK_REDUCTION_A2:
      config->reduction = BlockReduction::kA2;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown reduction ", settings.reduction()));
  }
  switch (settings.exploration()) {
    case v1::EXPLORATION_POLICY_UNSPECIFIED:
    case v1::EXPLORATION_POLICY_RANDOM:
      config->exploration = ExplorationPolicy::kRandom;
      break;
    case v1::EXPLORATION_POLICY_STALENESS_SCORE:
      config->exploration = ExplorationPolicy::kStalenessScore;
      break;
    case v1::EXPLORATION_POLICY_BLOCK_AGE:
      config->exploration = ExplorationPolicy::kBlockAge;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown exploration policy ", settings.exploration()));
  }
  switch (settings.spec_mask()) {
    case v1::SPEC_MASK_POLICY_UNSPECIFIED:
    case v1::SPEC_MASK_POLICY_ROW_LOCAL_UNION:
      config->spec_mask = SpecMaskPolicy::kRowLocalUnion;
      break;
    case v1::SPEC_MASK_POLICY_ROW0_SHARING:
      config->spec_mask = SpecMaskPolicy::kRow0Sharing;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown spec mask policy ", settings.spec_mask()));
  }
  switch (settings.spec_update()) {
    case v1::SPEC_UPDATE_POLICY_UNSPECIFIED:
    case v1::SPEC_UPDATE_POLICY_PREFIX_VALID:
      config->spec_update = SpecUpdatePolicy::kPrefixValid;
      break;
    case v1::SPEC_UPDATE_POLICY_ROW0:
      config->spec_update = SpecUpdatePolicy::kRow0;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown spec update policy ", settings.spec_update()));
  }
  config->seed = settings.seed();
  if (settings.has_miss_target()) config->miss_target = settings.miss_target();
  return absl::OkStatus();
}

v1::SpinSettings ToSpinSettings(const SpinConfig& config) {
  v1::SpinSettings settings;
  if (config.enabled) {
    settings.set_target_block_sparsity(config.target_block_sparsity);
  } else {
    settings.set_all_keep(true);
  }
  settings.set_ema_decay(config.ema_decay);
  settings.set_exploration_fraction(config.exploration_fraction);
  if (config.miss_target.has_value()) settings.set_miss_target(*config.miss_target);
  switch (config.pooling) {
    case BlockPooling::kMax:
      settings.set_pooling(v1::BLOCK_POOLING_MAX);
      break;
    case BlockPooling::kTop4Mean:
      settings.set_pooling(v1::BLOCK_POOLING_TOP4_MEAN);
      break;
    case BlockPooling::kMean:
      settings.set_pooling(v1::BLOCK_POOLING_MEAN);
      break;
  }
  switch (config.reduction) {
    case BlockReduction::kA0:
      settings.set_reduction(v1::BLOCK_REDUCTION_A0);
      break;
    case BlockReduction::kA1:
      settings.set_reduction(v1::BLOCK_REDUCTION_A1);
      break;
    case BlockReduction::kA2:
      settings.set_reduction(v1::BLOCK_REDUCTION_A2);
      break;
  }
  switch (config.exploration) {
    case ExplorationPolicy::kRandom:
      settings.set_exploration(v1::EXPLORATION_POLICY_RANDOM);
      break;
    case ExplorationPolicy::kStalenessScore:
      settings.set_exploration(v1::EXPLORATION_POLICY_STALENESS_SCORE);
      break;
    case ExplorationPolicy::kBlockAge:
      settings.set_exploration(v1::EXPLORATION_POLICY_BLOCK_AGE);
      break;
  }
  switch (config.spec_mask) {
    case SpecMaskPolicy::kRowLocalUnion:
      settings.set_spec_mask(v1::SPEC_MASK_POLICY_ROW_LOCAL_UNION);
      break;
    case SpecMaskPolicy::kRow0Sharing:
      settings.set_spec_mask(v1::SPEC_MASK_POLICY_ROW0_SHARING);
      break;
  }
  switch (config.spec_update) {
    case SpecUpdatePolicy::kPrefixValid:
      settings.set_spec_update(v1::SPEC_UPDATE_POLICY_PREFIX_VALID);
      break;
    case SpecUpdatePolicy::kRow0:
      settings.set_spec_update(v1::SPEC_UPDATE_POLICY_ROW0);
      break;
  }
  settings.set_seed(config.seed);
  return settings;
}

v1::SelectRequest EncodeSelectRequest(const LayerSelectRequest& request) {
  v1::SelectRequest proto;
  const int64_t num_heads = request.num_heads;
  const int64_t head_dim = request.head_dim;
  for (const SelectRowGroup& group : request.groups) {
    v1::RowGroup* out = proto.add_groups();
    out->set_sequence_id(group.sequence_id);
    out->set_layer(group.layer);
    out->set_first_position(group.first_position);
    const int64_t query_shape[] = {group.num_rows, num_heads, head_dim};
    EncodeFloatTensor(group.queries, query_shape, out->mutable_queries());
    const int64_t weight_shape[] = {group.num_rows, num_heads};
    EncodeFloatTensor(group.head_weights, weight_shape, out->mutable_head_weights());
    if (!group.new_index_keys.empty()) {
      const int64_t key_shape[] = {static_cast<int64_t>(group.new_index_keys.size()) / head_dim,
                                   head_dim};
      EncodeFloatTensor(group.new_index_keys, key_shape, out->mutable_new_index_keys());
    }
  }
  return proto;
}

absl::StatusOr<LayerSelection> DecodeSelectResponse(const v1::SelectResponse& response,
                                                    const std::vector<int>& group_rows) {
  if (response.selections_size() != static_cast<int>(group_rows.size())) {
    return absl::InternalError(absl::StrCat("the indexer answered ", response.selections_size(),
                                            " selections for ", group_rows.size(), " groups"));
  }
  LayerSelection selection;
  selection.groups.resize(group_rows.size());
  for (size_t g = 0; g < group_rows.size(); ++g) {
    const v1::GroupSelection& in = response.selections(static_cast<int>(g));
    GroupSelection& out = selection.groups[g];
    const int64_t shape[] = {group_rows[g], -1};
    auto values =
        DecodeInt32Tensor(in.selections(), shape, absl::StrCat("group ", g, " selections"));
    if (!values.ok()) return absl::InternalError(values.status().message());
    out.num_rows = group_rows[g];
    out.top_k = static_cast<int>(in.selections().shape(1));
    out.selections = std::move(*values);
    out.blocks_scored = in.blocks_scored();
    out.blocks_visible = in.blocks_visible();
    out.all_blocks = in.all_blocks();
    out.audit_miss_rates.assign(in.audit_miss_rates().begin(), in.audit_miss_rates().end());
  }
  return selection;
}

absl::StatusOr<LayerSelectRequest> DecodeSelectRequest(const v1::SelectRequest& request,
                                                       int num_heads, int head_dim) {
  if (request.groups().empty()) {
    return absl::InvalidArgumentError("select needs at least one group");
  }
  LayerSelectRequest decoded;
  decoded.num_heads = num_heads;
  decoded.head_dim = head_dim;
  decoded.groups.resize(request.groups_size());
  for (int g = 0; g < request.groups_size(); ++g) {
    DSA_RETURN_IF_ERROR(DecodeGroup(request.groups(g), g, num_heads, head_dim, &decoded.groups[g]));
  }
  return decoded;
}

void EncodeSelectResponse(const LayerSelection& selection, uint64_t request_id,
                          v1::SelectResponse* response) {
  response->Clear();
  response->set_request_id(request_id);
  for (const GroupSelection& group : selection.groups) {
    v1::GroupSelection* out = response->add_selections();
    const int64_t shape[] = {group.num_rows, group.top_k};
    EncodeInt32Tensor(group.selections, shape, out->mutable_selections());
    out->set_blocks_scored(group.blocks_scored);
    out->set_blocks_visible(group.blocks_visible);
    out->set_all_blocks(group.all_blocks);
    for (const double miss_rate : group.audit_miss_rates) out->add_audit_miss_rates(miss_rate);
  }
}

void EncodeSelectError(const absl::Status& status, int groups_applied, uint64_t request_id,
                       v1::SelectResponse* response) {
  response->Clear();
  response->set_request_id(request_id);
  response->mutable_error()->set_code(static_cast<int32_t>(status.code()));
  response->mutable_error()->set_message(std::string(status.message()));
  response->mutable_error()->set_groups_applied(groups_applied);
}

absl::Status DecodeSelectError(const v1::SelectError& error, uint64_t request_id) {
  const int code = error.code();
  if (code < 1 || code > 16) {  // never OK, and only the codes gRPC defines
    return absl::InternalError(absl::StrCat("indexer answered request ", request_id,
                                            " with an invalid status code ", code, ": ",
                                            error.message()));
  }
  absl::Status refused(static_cast<absl::StatusCode>(code), error.message());
  refused.SetPayload(kGroupsAppliedPayload, absl::Cord(absl::StrCat(error.groups_applied())));
  return refused;
}

}  // namespace dsa
