// The attention worker's gRPC adapter (see service.h).
#include "attention_worker/service.h"

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cpu_attention_backend.h"
#include "common/instance_id.h"
#include "common/status_macros.h"
#include "common/trace_context.h"
#include "contracts/grpc_status.h"
#include "proto/indexer_codec.h"
#include "proto/lease_codec.h"
#include "server/log.h"
#include "transport/grpc_indexer_client.h"

namespace dsa {

namespace av1 = ::dsa::attention::v1;

namespace {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

absl::StatusOr<PrefillSpec> ToPrefillSpec(const av1::PrefillRequest& request) {
  PrefillSpec spec;
  spec.sequence_id = request.sequence_id();
  spec.context_length = request.context_length();
  spec.prefix_block_ids.assign(request.prefix_block_ids().begin(),
                               request.prefix_block_ids().end());
  spec.indexer_worker = request.indexer_worker();
  spec.top_k = request.settings().top_k();
  DSA_RETURN_IF_ERROR(ToSpinConfig(request.settings().spin(), &spec.spin));
  if (request.has_prefix_source_id()) spec.prefix_source_id = request.prefix_source_id();
  spec.prefix_slots = request.prefix_slots();
  spec.continue_sequence = request.continue_sequence();
  spec.tokens.assign(request.tokens().begin(), request.tokens().end());
  spec.sampling.temperature = request.sampling().temperature();
  spec.sampling.top_p = request.sampling().top_p() == 0.0f ? 1.0f : request.sampling().top_p();
  spec.sampling.seed = request.sampling().seed();
  return spec;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> MakeCpuAttentionEngine(
    MliSchedule schedule, PatternModel model, const AttentionWorkerOptions& options,
    IndexerClientFactory indexer_clients, AttentionMetrics* metrics) {
  CpuAttentionBackendOptions backend_options;
  backend_options.num_model_layers = schedule.num_layers();
  backend_options.kv_dim = options.kv_dim;
  backend_options.attention_heads = options.attention_heads;
  backend_options.seed = options.seed;
  backend_options.fill_threads = options.engine.prefill_threads;
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<CpuAttentionBackend> backend,
                       CpuAttentionBackend::Create(backend_options));
  return AttentionEngine::Create(std::move(schedule), std::move(model), std::move(backend),
                                 std::move(indexer_clients), options.engine, metrics);
}

AttentionServiceImpl::AttentionServiceImpl(std::unique_ptr<AttentionEngine> engine,
                                           const Clock* clock)
    : engine_(std::move(engine)), leases_(clock) {}

absl::StatusOr<std::unique_ptr<AttentionServiceImpl>> AttentionServiceImpl::Create(
    MliSchedule schedule, PatternModel model, const AttentionWorkerOptions& options,
    AttentionMetrics* metrics) {
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<AttentionEngine> engine,
                       MakeCpuAttentionEngine(std::move(schedule), std::move(model), options,
                                              GrpcIndexerClient::Factory(), metrics));
  return std::make_unique<AttentionServiceImpl>(std::move(engine));
}

grpc::Status AttentionServiceImpl::GetInfo(grpc::ServerContext* /*context*/,
                                           const av1::GetInfoRequest* /*request*/,
                                           av1::GetInfoResponse* response) {
  const AttentionEngineInfo info = engine_->GetInfo();
  response->set_num_model_layers(info.num_model_layers);
  response->set_num_full_layers(info.num_full_layers);
  response->set_lag_depth(info.lag_depth);
  response->set_num_heads(info.num_heads);
  response->set_head_dim(info.head_dim);
  response->set_kv_capacity_slots(info.kv_capacity_slots);
  response->set_kv_used_slots(info.kv_used_slots);
  response->set_sequences(info.sequences);
  response->set_instance_id(ProcessInstanceId());
  response->set_model(info.model);
  response->set_vocab_size(info.vocab_size);
  response->set_eos_token_id(info.eos_token_id);
  response->set_max_context(info.max_context);
  return grpc::Status::OK;
}

namespace {

// The calling identity; "" without a context (a test calling a handler directly).
std::string Caller(const grpc::ServerContext* context) {
  return context != nullptr ? CallerIdentity(*context) : std::string();
}

constexpr absl::string_view kSequence = "sequence";

}  // namespace

grpc::Status AttentionServiceImpl::Prefill(grpc::ServerContext* context,
                                           const av1::PrefillRequest* request,
                                           av1::PrefillResponse* response) {
  const std::string id = absl::StrCat(request->sequence_id());
  const std::string caller = Caller(context);
  const SequenceLease lease = DecodeLease(request->lease());
  if (absl::Status usable = leases_.Check(lease, caller); !usable.ok()) {
    return ToGrpcStatus(absl::Status(usable.code(), absl::StrCat("lease: ", usable.message())));
  }
  // Each claim's end forgets a new owner unless the prefill succeeded (OwnerTable::Claim).
  absl::StatusOr<OwnerTable::Claim> claim = owners_.Acquire(id, caller, kSequence);
  if (!claim.ok()) return ToGrpcStatus(claim.status());
  OwnerTable::Claim indexer_claim;
  if (colocated_indexer_owners_ != nullptr) {
    // The engine clones the donor's index keys in process, past the indexer service's check that
    // a prefix source is the caller's: check it here.
    if (request->has_prefix_source_id()) {
      if (absl::Status donor = colocated_indexer_owners_->Check(
              absl::StrCat(request->prefix_source_id()), caller, kSequence);
          !donor.ok()) {
        return ToGrpcStatus(
            absl::PermissionDeniedError(absl::StrCat("prefix_source_id: ", donor.message())));
      }
    }
    absl::StatusOr<OwnerTable::Claim> on_indexer =
        colocated_indexer_owners_->Acquire(id, caller, kSequence);
    if (!on_indexer.ok()) return ToGrpcStatus(on_indexer.status());
    indexer_claim = *std::move(on_indexer);
  }
  grpc::Status status = OwnedPrefill(context, request, lease, response);
  if (status.ok() && context != nullptr && context->IsCancelled()) {
    // The caller gave up while it ran (its client left, an Abort, its deadline): it will not use
    // the sequence, and its Release may have come before the sequence existed (NOT_FOUND). Drop
    // what the prefill made, on the indexer too, so that a cancelled prefill leaves nothing.
    (void)engine_->Release(request->sequence_id(), /*keep_indexer_sequence=*/false);
    owners_.Forget(id, caller);  // a continued sequence's owner; a new claim is forgotten below
    if (colocated_indexer_owners_ != nullptr) colocated_indexer_owners_->Forget(id, caller);
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the caller cancelled the prefill: what it made was released");
  }
  if (!status.ok()) return status;
  claim->Keep();
  indexer_claim.Keep();
  absl::Status attached = AttachLease(request->sequence_id(), lease, caller);
  if (!attached.ok()) {
    // Superseded while it ran: the sequence must not outlive its owner unleased.
    ReleaseLeased({request->sequence_id()}, "superseded");
    return ToGrpcStatus(absl::Status(attached.code(), absl::StrCat("lease: ", attached.message())));
  }
  return status;
}

absl::Status AttentionServiceImpl::AttachLease(uint64_t id, const SequenceLease& lease,
                                               const std::string& caller) {
  absl::StatusOr<SequenceLeases::Renewal> attached = leases_.Attach(id, lease, caller);
  if (!attached.ok()) return attached.status();
  ReleaseLeased(attached->released, attached->reason());
  if (colocated_indexer_ != nullptr) return colocated_indexer_->AttachLease(id, lease);
  return absl::OkStatus();
}

grpc::Status AttentionServiceImpl::RenewLease(grpc::ServerContext* context,
                                              const av1::RenewLeaseRequest* request,
                                              av1::RenewLeaseResponse* response) {
  absl::StatusOr<SequenceLeases::Renewal> renewal =
      leases_.Renew(DecodeLease(request->lease()), Caller(context));
  if (!renewal.ok()) return ToGrpcStatus(renewal.status());
  ReleaseLeased(renewal->released, renewal->reason());
  dsa::common::v1::LeaseState* state = response->mutable_state();
  state->set_renewed(renewal->renewed);
  state->set_sequences(renewal->sequences);
  state->set_superseded_released(renewal->superseded);
  return grpc::Status::OK;
}

int64_t AttentionServiceImpl::ReleaseExpiredLeases() {
  const std::vector<uint64_t> expired = leases_.TakeExpired();
  ReleaseLeased(expired, "expired");
  return static_cast<int64_t>(expired.size());
}

void AttentionServiceImpl::ReleaseLeased(const std::vector<uint64_t>& ids, const char* reason) {
  if (ids.empty()) return;
  int64_t released = 0;
  for (const uint64_t id : ids) {
    leases_.Detach(id);
    if (engine_->Release(id, /*keep_indexer_sequence=*/false).ok()) ++released;
    const std::string key = absl::StrCat(id);
    owners_.Erase(key);
    if (colocated_indexer_ != nullptr) {
      colocated_indexer_owners_->Erase(key);
      colocated_indexer_->DetachLease(id);
    }
  }
  LogJson("info", "released the sequences of an ended lease",
          {{"reason", reason}, {"sequences", released}});
}

grpc::Status AttentionServiceImpl::OwnedPrefill(grpc::ServerContext* context,
                                                const av1::PrefillRequest* request,
                                                const SequenceLease& lease,
                                                av1::PrefillResponse* response) {
  const SteadyClock::time_point start = SteadyClock::now();
  // The indexer calls of this prefill carry the caller's trace (common/trace_context.h).
  std::optional<TraceContext> trace;
  if (context != nullptr) {
    auto it = context->client_metadata().find(kTraceparentKey);
    if (it != context->client_metadata().end()) {
      trace = ParseTraceparent(absl::string_view(it->second.data(), it->second.size()));
    }
  }
  const ScopedTraceContext scoped(std::move(trace));
  absl::StatusOr<PrefillSpec> spec = ToPrefillSpec(*request);
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  spec->lease = lease;
  absl::StatusOr<PrefillResult> result = engine_->Prefill(*spec);
  if (!result.ok()) return ToGrpcStatus(result.status());
  response->set_slots(result->slots);
  response->set_slots_appended(result->slots_appended);
  if (result->next_token.has_value()) response->set_next_token(*result->next_token);
  response->set_seconds(SecondsSince(start));
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::DecodeStep(grpc::ServerContext* context,
                                              const av1::DecodeStepRequest* request,
                                              av1::DecodeStepResponse* response) {
  const SteadyClock::time_point start = SteadyClock::now();
  const std::string caller = Caller(context);
  std::vector<StepMember> members;
  members.reserve(request->sequences_size());
  for (const av1::SequenceStep& s : request->sequences()) {
    if (absl::Status owned = owners_.Check(absl::StrCat(s.sequence_id()), caller, kSequence);
        !owned.ok()) {
      return ToGrpcStatus(owned);
    }
    members.push_back(
        StepMember{s.sequence_id(), s.rows(), {s.tokens().begin(), s.tokens().end()}});
  }
  absl::StatusOr<DecodeStepResult> result = engine_->DecodeStep(members);
  if (!result.ok()) return ToGrpcStatus(result.status());
  for (const SequenceStepResult& s : result->sequences) {
    av1::SequenceStepResult* out = response->add_sequences();
    out->set_sequence_id(s.sequence_id);
    out->set_first_position(s.first_position);
    out->set_blocks_scored(s.blocks_scored);
    out->set_blocks_visible(s.blocks_visible);
    out->set_audited_rows(s.audited_rows);
    out->set_audit_miss_rate_sum(s.audit_miss_rate_sum);
    out->mutable_sampled_tokens()->Add(s.sampled_tokens.begin(), s.sampled_tokens.end());
  }
  response->mutable_selection_wait_seconds()->Add(result->selection_wait_seconds.begin(),
                                                  result->selection_wait_seconds.end());
  response->set_seconds(SecondsSince(start));
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::Commit(grpc::ServerContext* context,
                                          const av1::CommitRequest* request,
                                          av1::CommitResponse* /*response*/) {
  if (absl::Status owned =
          owners_.Check(absl::StrCat(request->sequence_id()), Caller(context), kSequence);
      !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  return ToGrpcStatus(engine_->Commit(request->sequence_id(), request->accepted()));
}

grpc::Status AttentionServiceImpl::Release(grpc::ServerContext* context,
                                           const av1::ReleaseRequest* request,
                                           av1::ReleaseResponse* /*response*/) {
  const std::string id = absl::StrCat(request->sequence_id());
  const std::string caller = Caller(context);
  if (absl::Status owned = owners_.Check(id, caller, kSequence); !owned.ok()) {
    return ToGrpcStatus(owned);
  }
  const absl::Status status =
      engine_->Release(request->sequence_id(), request->keep_indexer_sequence());
  // Whatever the status, the sequence is gone here: NOT_FOUND, or its KV dropped before the
  // indexer was told (an error then is the indexer's, which the coordinator releases directly).
  owners_.Forget(id, caller);
  leases_.Detach(request->sequence_id());
  // Released on the indexer too: its owner goes. Kept (a prefix donor), or an error or NOT_FOUND
  // (the indexer sequence may live on, a donor kept earlier, say): it stays the caller's until it
  // is released at the indexer port, which forgets it.
  if (colocated_indexer_owners_ != nullptr && status.ok() && !request->keep_indexer_sequence()) {
    colocated_indexer_owners_->Forget(id, caller);
    colocated_indexer_->DetachLease(request->sequence_id());
  }
  return ToGrpcStatus(status);
}

}  // namespace dsa
