// The gRPC adapter of the indexer worker (see grpc_service.h).
#include "indexer_service/grpc_service.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/tensor_codec.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::indexer::v1;

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
  return absl::OkStatus();
}

absl::Status CheckFinite(const std::vector<float>& values, const std::string& name) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

// One group decoded and checked, ready to run.
struct DecodedGroup {
  std::vector<float> queries;   // [rows, H, D]
  std::vector<float> weights;   // [rows, H]
  std::vector<float> new_keys;  // [num_new_keys, D]
  int64_t num_new_keys = 0;
  int64_t slots_before = 0;  // the layer's slot count when the request was checked
  std::vector<IndexerRow> rows;
};

absl::Status DecodeGroup(const Indexer& indexer, const v1::RowGroup& group, size_t index,
                         DecodedGroup* decoded) {
  const int64_t num_heads = indexer.options().num_heads;
  const int64_t head_dim = indexer.options().head_dim;
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
  DSA_ASSIGN_OR_RETURN(decoded->weights, DecodeFloatTensor(group.head_weights(), weight_shape,
                                                           prefix + "head_weights"));
  DSA_RETURN_IF_ERROR(CheckFinite(decoded->queries, prefix + "queries"));
  DSA_RETURN_IF_ERROR(CheckFinite(decoded->weights, prefix + "head_weights"));
  if (group.first_position() < 0 || group.first_position() >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "first_position ", group.first_position(), " outside [0, 2^31) (a layer's slots)"));
  }
  auto slots = indexer.NumSlots(group.sequence_id(), group.layer());
  if (!slots.ok()) {
    return absl::Status(slots.status().code(), prefix + std::string(slots.status().message()));
  }
  decoded->slots_before = *slots;
  const int64_t last_position = group.first_position() + num_rows - 1;
  if (group.has_new_index_keys()) {
    const int64_t key_shape[] = {-1, head_dim};
    DSA_ASSIGN_OR_RETURN(decoded->new_keys, DecodeFloatTensor(group.new_index_keys(), key_shape,
                                                              prefix + "new_index_keys"));
    DSA_RETURN_IF_ERROR(CheckFinite(decoded->new_keys, prefix + "new_index_keys"));
    decoded->num_new_keys = group.new_index_keys().shape(0);
    const int64_t newest = *slots + decoded->num_new_keys - 1;
    if (decoded->num_new_keys > 0 && last_position != newest) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "rows end at position ", last_position, " but with ",
                       decoded->num_new_keys, " new index keys layer ", group.layer(),
                       "'s newest slot is ", newest, "; rows must end at the newest slot"));
    }
  }
  if (last_position >= *slots + decoded->num_new_keys) {
    return absl::OutOfRangeError(absl::StrCat(prefix, "rows up to position ", last_position,
                                              " but layer ", group.layer(), " holds ", *slots,
                                              " slots; append the rows' index keys first"));
  }
  const size_t query_size = static_cast<size_t>(num_heads * head_dim);
  decoded->rows.resize(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    decoded->rows[r].query =
        std::span<const float>(decoded->queries.data() + r * query_size, query_size);
    decoded->rows[r].head_weights =
        std::span<const float>(decoded->weights.data() + r * num_heads, num_heads);
    decoded->rows[r].position = group.first_position() + r;
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status RunSelect(Indexer& indexer, const v1::SelectRequest& request,
                       v1::SelectResponse* response, IndexerMetrics* metrics,
                       int* groups_applied_out) {
  if (groups_applied_out != nullptr) *groups_applied_out = 0;
  if (request.groups().empty())
    return absl::InvalidArgumentError("select needs at least one group");
  std::vector<DecodedGroup> decoded(request.groups_size());
  for (int g = 0; g < request.groups_size(); ++g) {
    DSA_RETURN_IF_ERROR(DecodeGroup(indexer, request.groups(g), g, &decoded[g]));
  }
  // New index keys make a (sequence, layer)'s slot count change within the request: such a layer
  // may appear in one group only.
  for (int g = 0; g < request.groups_size(); ++g) {
    for (int h = 0; h < g; ++h) {
      const v1::RowGroup& a = request.groups(h);
      const v1::RowGroup& b = request.groups(g);
      if (a.sequence_id() == b.sequence_id() && a.layer() == b.layer() &&
          (decoded[g].num_new_keys > 0 || decoded[h].num_new_keys > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("groups ", h, " and ", g, " both address layer ", a.layer(),
                         " of sequence ", a.sequence_id(), " and carry new index keys"));
      }
    }
  }
  // Appends first, all or none; then the selects (one batch). When the batch fails, the new keys
  // of the groups it did not apply are removed again.
  // Removes the new keys of groups [from, to), newest first.
  auto undo_appends = [&](int from, int to) {
    for (int g = to - 1; g >= from; --g) {
      if (decoded[g].num_new_keys > 0) {
        (void)indexer.TruncateIndexKeys(request.groups(g).sequence_id(), request.groups(g).layer(),
                                        decoded[g].slots_before);
      }
    }
  };
  for (int g = 0; g < request.groups_size(); ++g) {
    if (decoded[g].num_new_keys == 0) continue;
    const v1::RowGroup& group = request.groups(g);
    const absl::Status appended = indexer.AppendIndexKeys(
        group.sequence_id(), group.layer(), decoded[g].new_keys, decoded[g].num_new_keys);
    if (!appended.ok()) {
      undo_appends(0, g);  // groups before g appended; g did not
      return absl::Status(appended.code(),
                          absl::StrCat("group ", g, " new_index_keys: ", appended.message()));
    }
  }
  std::vector<SelectGroup> groups(request.groups_size());
  for (int g = 0; g < request.groups_size(); ++g) {
    groups[g] = {request.groups(g).sequence_id(), request.groups(g).layer(), decoded[g].rows};
  }
  size_t groups_applied = 0;
  auto results = indexer.SelectBatch(groups, &groups_applied);
  response->Clear();
  if (!results.ok()) {
    undo_appends(static_cast<int>(groups_applied), request.groups_size());
    if (groups_applied_out != nullptr) *groups_applied_out = static_cast<int>(groups_applied);
    return results.status();
  }
  response->set_request_id(request.request_id());
  for (int g = 0; g < request.groups_size(); ++g) {
    const SelectResult& result = (*results)[g];
    if (metrics != nullptr) metrics->RecordSelect(result);
    v1::GroupSelection* selection = response->add_selections();
    const int64_t shape[] = {static_cast<int64_t>(decoded[g].rows.size()), result.top_k};
    EncodeInt32Tensor(result.selections, shape, selection->mutable_selections());
    selection->set_blocks_scored(result.blocks_scored);
    selection->set_blocks_visible(result.blocks_visible);
    selection->set_all_blocks(result.all_blocks);
    for (const double miss_rate : result.audit_miss_rates) {
      selection->add_audit_miss_rates(miss_rate);
    }
  }
  return absl::OkStatus();
}

void IndexerServiceImpl::UpdateCacheMetrics() {
  if (metrics_ != nullptr) metrics_->SetCacheUsage(indexer_->Usage());
}

grpc::Status IndexerServiceImpl::CreateSequence(grpc::ServerContext* /*context*/,
                                                const v1::CreateSequenceRequest* request,
                                                v1::CreateSequenceResponse* /*response*/) {
  SequenceOptions options;
  options.num_layers = request->num_layers();
  options.top_k = request->top_k();
  if (auto s = ToSpinConfig(request->spin(), &options.spin); !s.ok()) return ToGrpcStatus(s);
  if (request->has_prefix_source_id()) {
    const absl::Status status = indexer_->CreateSequenceFromPrefix(
        request->sequence_id(), options, request->prefix_source_id(), request->prefix_slots());
    UpdateCacheMetrics();
    return ToGrpcStatus(status);
  }
  if (request->prefix_slots() != 0) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("prefix_slots is set but prefix_source_id is not"));
  }
  return ToGrpcStatus(indexer_->CreateSequence(request->sequence_id(), options));
}

grpc::Status IndexerServiceImpl::AppendIndexKeys(
    grpc::ServerContext* context, grpc::ServerReader<v1::AppendIndexKeysRequest>* reader,
    v1::AppendIndexKeysResponse* response) {
  struct Touched {
    uint64_t sequence_id;
    int layer;
    int64_t original_slots;
  };
  std::vector<Touched> touched;  // (sequence, layer) this call appended to, first touch order
  int64_t keys_appended = 0;
  const int64_t key_shape[] = {-1, indexer_->options().head_dim};
  auto append_chunk = [&](const v1::AppendIndexKeysRequest& chunk, int64_t index) -> absl::Status {
    if (chunk.ByteSizeLong() > static_cast<size_t>(kMaxAppendChunkBytes)) {
      return absl::ResourceExhaustedError(absl::StrCat("chunk ", index, " is ",
                                                       chunk.ByteSizeLong(), " bytes, over the ",
                                                       kMaxAppendChunkBytes, "-byte chunk limit"));
    }
    const std::string name = absl::StrCat("chunk ", index, " keys");
    DSA_ASSIGN_OR_RETURN(std::vector<float> keys, DecodeFloatTensor(chunk.keys(), key_shape, name));
    DSA_ASSIGN_OR_RETURN(int64_t slots, indexer_->NumSlots(chunk.sequence_id(), chunk.layer()));
    if (chunk.first_slot() != slots) {
      return absl::FailedPreconditionError(absl::StrCat(
          "chunk ", index, ": first_slot ", chunk.first_slot(), " but layer ", chunk.layer(),
          " of sequence ", chunk.sequence_id(), " holds ", slots, " slots"));
    }
    const int64_t num_keys = chunk.keys().shape(0);
    DSA_RETURN_IF_ERROR(
        indexer_->AppendIndexKeys(chunk.sequence_id(), chunk.layer(), keys, num_keys));
    bool seen = false;
    for (const Touched& t : touched) {
      seen = seen || (t.sequence_id == chunk.sequence_id() && t.layer == chunk.layer());
    }
    if (!seen) touched.push_back({chunk.sequence_id(), chunk.layer(), slots});
    keys_appended += num_keys;
    return absl::OkStatus();
  };

  absl::Status status;
  v1::AppendIndexKeysRequest chunk;
  int64_t index = 0;
  while (reader->Read(&chunk)) {
    status = append_chunk(chunk, index++);
    if (!status.ok()) break;
  }
  if (status.ok() && context->IsCancelled()) {
    status = absl::CancelledError("the client cancelled the append");
  }
  if (!status.ok()) {
    // Undo this call's appends, newest layer first. A rollback can only fail when the sequence was
    // released meanwhile, and then there is nothing left to undo.
    for (auto it = touched.rbegin(); it != touched.rend(); ++it) {
      (void)indexer_->TruncateIndexKeys(it->sequence_id, it->layer, it->original_slots);
    }
    UpdateCacheMetrics();
    return ToGrpcStatus(status);
  }
  UpdateCacheMetrics();
  response->set_keys_appended(keys_appended);
  return grpc::Status::OK;
}

grpc::Status IndexerServiceImpl::Select(grpc::ServerContext* /*context*/,
                                        const v1::SelectRequest* request,
                                        v1::SelectResponse* response) {
  const absl::Status status = RunSelect(*indexer_, *request, response, metrics_);
  UpdateCacheMetrics();  // new index keys may have taken blocks
  return ToGrpcStatus(status);
}

grpc::Status IndexerServiceImpl::SelectStream(
    grpc::ServerContext* /*context*/,
    grpc::ServerReaderWriter<v1::SelectResponse, v1::SelectRequest>* stream) {
  v1::SelectRequest request;
  v1::SelectResponse response;
  while (stream->Read(&request)) {
    // One stream carries many sequences' layers: a refused request gets its own status and the
    // others go on.
    int groups_applied = 0;
    if (auto s = RunSelect(*indexer_, request, &response, metrics_, &groups_applied); !s.ok()) {
      response.Clear();
      response.set_request_id(request.request_id());
      response.mutable_error()->set_code(static_cast<int32_t>(s.code()));
      response.mutable_error()->set_message(std::string(s.message()));
      response.mutable_error()->set_groups_applied(groups_applied);
    }
    UpdateCacheMetrics();
    if (!stream->Write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client closed the stream");
    }
  }
  return grpc::Status::OK;
}

grpc::Status IndexerServiceImpl::Commit(grpc::ServerContext* /*context*/,
                                        const v1::CommitRequest* request,
                                        v1::CommitResponse* /*response*/) {
  const absl::Status status = indexer_->Commit(request->sequence_id(), request->accepted());
  UpdateCacheMetrics();  // Commit frees the rejected draft tokens' blocks
  return ToGrpcStatus(status);
}

grpc::Status IndexerServiceImpl::BeginTurn(grpc::ServerContext* /*context*/,
                                           const v1::BeginTurnRequest* request,
                                           v1::BeginTurnResponse* /*response*/) {
  return ToGrpcStatus(indexer_->BeginTurn(request->sequence_id()));
}

grpc::Status IndexerServiceImpl::Release(grpc::ServerContext* /*context*/,
                                         const v1::ReleaseRequest* request,
                                         v1::ReleaseResponse* /*response*/) {
  const absl::Status status = indexer_->Release(request->sequence_id());
  UpdateCacheMetrics();
  return ToGrpcStatus(status);
}

grpc::Status IndexerServiceImpl::GetLoad(grpc::ServerContext* /*context*/,
                                         const v1::GetLoadRequest* /*request*/,
                                         v1::GetLoadResponse* response) {
  const CacheUsage usage = indexer_->Usage();
  if (metrics_ != nullptr) metrics_->SetCacheUsage(usage);
  response->set_capacity_blocks(usage.capacity_blocks);
  response->set_used_blocks(usage.used_blocks);
  response->set_shared_blocks(usage.shared_blocks);
  response->set_free_blocks(usage.free_blocks);
  response->set_sequences(indexer_->num_sequences());
  response->set_num_heads(indexer_->options().num_heads);
  response->set_head_dim(indexer_->options().head_dim);
  return grpc::Status::OK;
}

}  // namespace dsa
