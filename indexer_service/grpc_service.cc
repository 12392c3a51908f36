// The gRPC adapter of the indexer worker (see grpc_service.h).
#include "indexer_service/grpc_service.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/instance_id.h"
#include "common/status_macros.h"
#include "indexer_service/index_key_append.h"
#include "indexer_service/layer_select.h"
#include "proto/indexer_codec.h"
#include "proto/lease_codec.h"
#include "proto/tensor_codec.h"
#include "server/log.h"
#include "server/parse_errors.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::indexer::v1;

// The streaming methods' positions in dsa.indexer.v1.IndexerService (indexer.proto's order), for
// grpc::Service::MarkMethodStreamed. A wrong index fails GrpcServiceTest's unparseable-message
// tests.
constexpr int kAppendIndexKeysMethod = 1;
constexpr int kSelectStreamMethod = 3;

// RESOURCE_EXHAUSTED when the answer to `request` could pass kMaxReceiveMessageBytes. Groups of
// unknown sequences count nothing (the select refuses them anyway).
absl::Status CheckSelectResponseFits(const Indexer& indexer, const v1::SelectRequest& request) {
  int64_t bound = kSelectResponseFramingBytes;
  for (const v1::RowGroup& group : request.groups()) {
    const absl::StatusOr<int> top_k = indexer.TopK(group.sequence_id());
    if (!top_k.ok() || group.queries().shape_size() < 1) continue;
    bound += SelectResponseBytesBound(group.queries().shape(0), *top_k);
    if (bound > kMaxReceiveMessageBytes) break;  // refused below; adding more could overflow
  }
  if (bound <= kMaxReceiveMessageBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the selections of this request could take ", bound, " bytes, over the message limit of ",
      kMaxReceiveMessageBytes, " bytes (kMaxReceiveMessageBytes): send fewer rows per request"));
}

}  // namespace

absl::Status RunSelect(Indexer& indexer, const v1::SelectRequest& request,
                       v1::SelectResponse* response, IndexerMetrics* metrics,
                       int* groups_applied_out) {
  if (groups_applied_out != nullptr) *groups_applied_out = 0;
  response->Clear();
  if (request.groups().empty())
    return absl::InvalidArgumentError("select needs at least one group");
  DSA_RETURN_IF_ERROR(CheckSelectResponseFits(indexer, request));
  DSA_ASSIGN_OR_RETURN(
      LayerSelectRequest decoded,
      DecodeSelectRequest(request, indexer.options().num_heads, indexer.options().head_dim));
  DSA_ASSIGN_OR_RETURN(LayerSelection selection,
                       RunLayerSelect(indexer, decoded, metrics, groups_applied_out));
  EncodeSelectResponse(selection, request.request_id(), response);
  return absl::OkStatus();
}

namespace {

// The calling identity; "" without a context (a test calling a handler directly).
std::string Caller(const grpc::ServerContext* context) {
  return context != nullptr ? CallerIdentity(*context) : std::string();
}

constexpr absl::string_view kSequence = "sequence";

// The caller every lease is used as here: any attention worker creates under its coordinator's
// lease, and the coordinator renews it (IndexerServiceImpl's constructor comment).
const std::string kAnyLeaseCaller;

}  // namespace

IndexerServiceImpl::IndexerServiceImpl(Indexer* indexer, IndexerMetrics* metrics,
                                       std::vector<std::string> operator_identities,
                                       const Clock* clock)
    : indexer_(indexer),
      metrics_(metrics),
      owners_(std::move(operator_identities)),
      leases_(clock) {
  // gRPC's synchronous handlers of bidi streams (the client-streaming AppendIndexKeys served as
  // one, which the wire cannot tell apart) over raw messages.
  MarkMethodStreamed(
      kAppendIndexKeysMethod,
      new grpc::internal::BidiStreamingHandler<IndexerServiceImpl, grpc::ByteBuffer,
                                               v1::AppendIndexKeysResponse>(
          [](IndexerServiceImpl* service, grpc::ServerContext* context,
             grpc::ServerReaderWriter<v1::AppendIndexKeysResponse, grpc::ByteBuffer>* stream) {
            return service->AppendIndexKeysRaw(context, stream);
          },
          this));
  MarkMethodStreamed(
      kSelectStreamMethod,
      new grpc::internal::BidiStreamingHandler<IndexerServiceImpl, grpc::ByteBuffer,
                                               v1::SelectResponse>(
          [](IndexerServiceImpl* service, grpc::ServerContext* context,
             grpc::ServerReaderWriter<v1::SelectResponse, grpc::ByteBuffer>* stream) {
            return service->SelectStreamRaw(context, stream);
          },
          this));
}

void IndexerServiceImpl::UpdateCacheMetrics() {
  if (metrics_ != nullptr) metrics_->SetCacheUsage(indexer_->Usage());
}

absl::Status IndexerServiceImpl::CheckOwned(const v1::SelectRequest& request,
                                            const std::string& caller) const {
  for (const v1::RowGroup& group : request.groups()) {
    DSA_RETURN_IF_ERROR(owners_.Check(absl::StrCat(group.sequence_id()), caller, kSequence));
  }
  return absl::OkStatus();
}

grpc::Status IndexerServiceImpl::CreateSequence(grpc::ServerContext* context,
                                                const v1::CreateSequenceRequest* request,
                                                v1::CreateSequenceResponse* response) {
  const std::string id = absl::StrCat(request->sequence_id());
  const std::string caller = Caller(context);
  if (request->has_prefix_source_id()) {
    // Cloning a prefix reads the source's index keys: only its owner (or an operator) may.
    if (absl::Status owned =
            owners_.Check(absl::StrCat(request->prefix_source_id()), caller, kSequence);
        !owned.ok()) {
      return ToGrpcStatus(
          absl::PermissionDeniedError(absl::StrCat("prefix_source_id: ", owned.message())));
    }
  }
  const SequenceLease lease = DecodeLease(request->lease());
  if (absl::Status usable = leases_.Check(lease, kAnyLeaseCaller); !usable.ok()) {
    return ToGrpcStatus(absl::Status(usable.code(), absl::StrCat("lease: ", usable.message())));
  }
  absl::StatusOr<OwnerTable::Claim> claim = owners_.Acquire(id, caller, kSequence);
  if (!claim.ok()) return ToGrpcStatus(claim.status());
  grpc::Status status = CreateOwnedSequence(request, response);
  if (!status.ok()) return status;  // the claim's end forgets a new owner
  claim->Keep();
  if (absl::Status attached = AttachLease(request->sequence_id(), lease); !attached.ok()) {
    // Superseded between the check and now: the sequence must not outlive its owner unleased.
    (void)indexer_->Release(request->sequence_id());
    owners_.Forget(id, caller);
    UpdateCacheMetrics();
    return ToGrpcStatus(absl::Status(attached.code(), absl::StrCat("lease: ", attached.message())));
  }
  return status;
}

grpc::Status IndexerServiceImpl::RenewLease(grpc::ServerContext* /*context*/,
                                            const v1::RenewLeaseRequest* request,
                                            v1::RenewLeaseResponse* response) {
  absl::StatusOr<SequenceLeases::Renewal> renewal =
      leases_.Renew(DecodeLease(request->lease()), kAnyLeaseCaller);
  if (!renewal.ok()) return ToGrpcStatus(renewal.status());
  ReleaseLeased(renewal->released, renewal->reason());
  dsa::common::v1::LeaseState* state = response->mutable_state();
  state->set_renewed(renewal->renewed);
  state->set_sequences(renewal->sequences);
  state->set_superseded_released(renewal->superseded);
  return grpc::Status::OK;
}

absl::Status IndexerServiceImpl::AttachLease(uint64_t id, const SequenceLease& lease) {
  absl::StatusOr<SequenceLeases::Renewal> attached = leases_.Attach(id, lease, kAnyLeaseCaller);
  if (!attached.ok()) return attached.status();
  ReleaseLeased(attached->released, attached->reason());
  return absl::OkStatus();
}

int64_t IndexerServiceImpl::ReleaseExpiredLeases() {
  const std::vector<uint64_t> expired = leases_.TakeExpired();
  ReleaseLeased(expired, "expired");
  return static_cast<int64_t>(expired.size());
}

void IndexerServiceImpl::ReleaseLeased(const std::vector<uint64_t>& ids, const char* reason) {
  if (ids.empty()) return;
  int64_t released = 0;
  for (const uint64_t id : ids) {
    if (indexer_->Release(id).ok()) ++released;
    owners_.Erase(absl::StrCat(id));
  }
  UpdateCacheMetrics();
  LogJson("info", "released the sequences of an ended lease",
          {{"reason", reason}, {"sequences", released}});
}

grpc::Status IndexerServiceImpl::CreateOwnedSequence(const v1::CreateSequenceRequest* request,
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

grpc::Status IndexerServiceImpl::AppendIndexKeysRaw(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::AppendIndexKeysResponse, grpc::ByteBuffer>* stream) {
  return AppendIndexKeysFrom(
      Caller(context), [stream](grpc::ByteBuffer* buffer) { return stream->Read(buffer); },
      [context] { return context->IsCancelled(); },
      [stream](const v1::AppendIndexKeysResponse& response) { return stream->Write(response); });
}

grpc::Status IndexerServiceImpl::AppendIndexKeysFrom(
    const std::string& caller, const std::function<bool(grpc::ByteBuffer*)>& read,
    const std::function<bool()>& cancelled,
    const std::function<bool(const v1::AppendIndexKeysResponse&)>& write) {
  IndexKeyAppendCall call(indexer_);
  const int64_t key_shape[] = {-1, indexer_->options().head_dim};
  auto append_chunk = [&](const v1::AppendIndexKeysRequest& chunk, int64_t index) -> absl::Status {
    if (absl::Status owned = owners_.Check(absl::StrCat(chunk.sequence_id()), caller, kSequence);
        !owned.ok()) {
      return absl::Status(owned.code(), absl::StrCat("chunk ", index, ": ", owned.message()));
    }
    if (chunk.ByteSizeLong() > static_cast<size_t>(kMaxAppendChunkBytes)) {
      return absl::ResourceExhaustedError(absl::StrCat("chunk ", index, " is ",
                                                       chunk.ByteSizeLong(), " bytes, over the ",
                                                       kMaxAppendChunkBytes, "-byte chunk limit"));
    }
    const std::string name = absl::StrCat("chunk ", index, " keys");
    DSA_ASSIGN_OR_RETURN(std::vector<float> keys, DecodeFloatTensor(chunk.keys(), key_shape, name));
    return call.Append(chunk.sequence_id(), chunk.layer(), chunk.first_slot(), keys,
                       chunk.keys().shape(0), absl::StrCat("chunk ", index, ": "));
  };

  absl::Status status;
  v1::AppendIndexKeysRequest chunk;
  grpc::ByteBuffer buffer;
  int64_t index = 0;
  while (read(&buffer)) {
    status = ParseStreamMessage(buffer, index, &chunk);
    if (status.ok()) status = append_chunk(chunk, index);
    ++index;
    if (!status.ok()) break;
  }
  if (status.ok() && cancelled()) {
    status = absl::CancelledError("the client cancelled the append");
  }
  if (!status.ok()) {
    call.Undo();
    UpdateCacheMetrics();
    return ToGrpcStatus(status);
  }
  UpdateCacheMetrics();
  v1::AppendIndexKeysResponse response;
  response.set_keys_appended(call.keys_appended());
  if (!write(response)) {
    call.Undo();
    UpdateCacheMetrics();
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away before the response");
  }
  return grpc::Status::OK;
}

grpc::Status IndexerServiceImpl::Select(grpc::ServerContext* context,
                                        const v1::SelectRequest* request,
                                        v1::SelectResponse* response) {
  if (absl::Status owned = CheckOwned(*request, Caller(context)); !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  const absl::Status status = RunSelect(*indexer_, *request, response, metrics_);
  UpdateCacheMetrics();  // new index keys may have taken blocks
  return ToGrpcStatus(status);
}

grpc::Status IndexerServiceImpl::SelectStreamRaw(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::SelectResponse, grpc::ByteBuffer>* stream) {
  return SelectStreamFrom(
      Caller(context), [stream](grpc::ByteBuffer* buffer) { return stream->Read(buffer); },
      [stream](const v1::SelectResponse& response) { return stream->Write(response); });
}

grpc::Status IndexerServiceImpl::SelectStreamFrom(
    const std::string& caller, const std::function<bool(grpc::ByteBuffer*)>& read,
    const std::function<bool(const v1::SelectResponse&)>& write) {
  v1::SelectRequest request;
  v1::SelectResponse response;
  grpc::ByteBuffer buffer;
  for (int64_t index = 0; read(&buffer); ++index) {
    if (auto s = ParseStreamMessage(buffer, index, &request); !s.ok()) return ToGrpcStatus(s);
    // One stream carries many sequences' layers: a refused request gets its own status and the
    // others go on.
    int groups_applied = 0;
    absl::Status s = CheckOwned(request, caller);
    if (s.ok()) s = RunSelect(*indexer_, request, &response, metrics_, &groups_applied);
    if (!s.ok()) EncodeSelectError(s, groups_applied, request.request_id(), &response);
    UpdateCacheMetrics();
    if (!write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client closed the stream");
    }
  }
  return grpc::Status::OK;
}

grpc::Status IndexerServiceImpl::Commit(grpc::ServerContext* context,
                                        const v1::CommitRequest* request,
                                        v1::CommitResponse* /*response*/) {
  if (absl::Status owned =
          owners_.Check(absl::StrCat(request->sequence_id()), Caller(context), kSequence);
      !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  const absl::Status status = indexer_->Commit(request->sequence_id(), request->accepted());
  UpdateCacheMetrics();  // Commit frees the rejected draft tokens' blocks
  return ToGrpcStatus(status);
}

grpc::Status IndexerServiceImpl::BeginTurn(grpc::ServerContext* context,
                                           const v1::BeginTurnRequest* request,
                                           v1::BeginTurnResponse* /*response*/) {
  if (absl::Status owned =
          owners_.Check(absl::StrCat(request->sequence_id()), Caller(context), kSequence);
      !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  return ToGrpcStatus(indexer_->BeginTurn(request->sequence_id()));
}

grpc::Status IndexerServiceImpl::Release(grpc::ServerContext* context,
                                         const v1::ReleaseRequest* request,
                                         v1::ReleaseResponse* /*response*/) {
  const std::string id = absl::StrCat(request->sequence_id());
  const std::string caller = Caller(context);
  if (absl::Status owned = owners_.Check(id, caller, kSequence); !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  const absl::Status status = indexer_->Release(request->sequence_id());
  if (status.ok() || absl::IsNotFound(status)) {
    owners_.Forget(id, caller);
    leases_.Detach(request->sequence_id());
  }
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
  response->set_instance_id(ProcessInstanceId());
  return grpc::Status::OK;
}

grpc::Status IndexerServiceImpl::OpenDataPlane(grpc::ServerContext* context,
                                               const v1::OpenDataPlaneRequest* request,
                                               v1::OpenDataPlaneResponse* response) {
  if (!data_plane_opener_) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "OpenDataPlane: this dsa-indexer was built without NCCL (serve selects "
                        "over SelectStream)");
  }
  DataPlaneCaller caller;
  caller.identity = Caller(context);
  caller.check_owned = [this, identity = caller.identity](uint64_t sequence_id) {
    return owners_.Check(absl::StrCat(sequence_id), identity, kSequence);
  };
  return ToGrpcStatus(data_plane_opener_(*request, caller, response));
}

}  // namespace dsa
