// The coordinator service: the gRPC adapter of CoordinatorEngine (see service.h).
#include "coordinator/service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <variant>

#include "common/trace_context.h"
#include "contracts/grpc_status.h"
#include "coordinator/worker_clients.h"
#include "server/security.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;

cv1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return cv1::FINISH_REASON_LENGTH;
    case FinishReason::kEos:
      return cv1::FINISH_REASON_EOS;
    case FinishReason::kStopToken:
      return cv1::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kUnspecified:
      break;
  }
  return cv1::FINISH_REASON_UNSPECIFIED;
}

// A Generate call's writer and context as the engine's stream.
class GrpcGenerateStream final : public GenerateStream {
 public:
  GrpcGenerateStream(grpc::ServerContext& context, grpc::ServerWriter<cv1::GenerateEvent>& writer)
      : context_(context), writer_(writer) {}
  bool Write(const GenerateEvent& event) override {
    return writer_.Write(ToGenerateEventProto(event));
  }
  bool IsCancelled() override { return context_.IsCancelled(); }
  void TryCancel() override { context_.TryCancel(); }

 private:
  grpc::ServerContext& context_;
  grpc::ServerWriter<cv1::GenerateEvent>& writer_;
};

}  // namespace

GenerateSpec ToGenerateSpec(const cv1::GenerateRequest& request) {
  GenerateSpec spec;
  spec.request_id = request.request_id();
  if (request.has_context_tokens()) {
    spec.context_tokens.emplace(request.context_tokens().tokens().begin(),
                                request.context_tokens().tokens().end());
  } else if (request.context_case() == cv1::GenerateRequest::kContextLength) {
    spec.context_length = request.context_length();
  }
  spec.prefix_block_ids.assign(request.prefix_block_ids().begin(),
                               request.prefix_block_ids().end());
  spec.max_new_tokens = request.max_new_tokens();
  spec.draft_length = request.draft_length();
  const cv1::Overrides& o = request.overrides();
  if (o.has_target_block_sparsity()) {
    spec.overrides.target_block_sparsity = o.target_block_sparsity();
  }
  if (o.has_exploration_fraction()) spec.overrides.exploration_fraction = o.exploration_fraction();
  if (o.has_top_k()) spec.overrides.top_k = o.top_k();
  if (o.has_all_keep()) spec.overrides.all_keep = o.all_keep();
  if (o.has_acceptance_rate()) spec.overrides.acceptance_rate = o.acceptance_rate();
  if (o.has_miss_target()) spec.overrides.miss_target = o.miss_target();
  spec.session_id = request.session_id();
  spec.sampling.temperature = request.sampling().temperature();
  spec.sampling.top_p = request.sampling().top_p();
  if (request.sampling().has_seed()) spec.sampling.seed = request.sampling().seed();
  spec.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  spec.ignore_eos = request.ignore_eos();
  return spec;
}

cv1::GenerateEvent ToGenerateEventProto(const GenerateEvent& event) {
  cv1::GenerateEvent proto;
  if (const auto* a = std::get_if<AdmittedEvent>(&event)) {
    cv1::Admitted* admitted = proto.mutable_admitted();
    admitted->set_queue_seconds(a->queue_seconds);
    admitted->set_indexer_worker(a->indexer_worker);
    admitted->set_attention_worker(a->attention_worker);
    admitted->set_prefix_slots_reused(a->prefix_slots_reused);
    admitted->set_prefill_seconds(a->prefill_seconds);
  } else if (const auto* t = std::get_if<TokensEvent>(&event)) {
    cv1::Tokens* tokens = proto.mutable_tokens();
    tokens->set_first_position(t->first_position);
    tokens->set_count(t->count);
    tokens->set_drafted(t->drafted);
    tokens->set_accepted(t->accepted);
    tokens->set_step_seconds(t->step_seconds);
    tokens->set_blocks_scored(t->blocks_scored);
    tokens->set_blocks_visible(t->blocks_visible);
    tokens->set_audited_rows(t->audited_rows);
    tokens->set_audit_miss_rate_sum(t->audit_miss_rate_sum);
    tokens->mutable_selection_wait_seconds()->Add(t->selection_wait_seconds.begin(),
                                                  t->selection_wait_seconds.end());
    tokens->mutable_token_ids()->Add(t->token_ids.begin(), t->token_ids.end());
  } else if (const auto* f = std::get_if<FinishedEvent>(&event)) {
    cv1::Finished* finished = proto.mutable_finished();
    finished->set_generated_tokens(f->generated_tokens);
    finished->set_time_to_first_token_seconds(f->time_to_first_token_seconds);
    finished->set_mean_inter_token_latency_seconds(f->mean_inter_token_latency_seconds);
    finished->set_migrations(f->migrations);
    finished->set_finish_reason(ToProto(f->finish_reason));
    if (f->stop_token_id.has_value()) finished->set_stop_token_id(*f->stop_token_id);
  }
  return proto;
}

cv1::GetLoadResponse ToGetLoadResponse(const CoordinatorLoad& load) {
  cv1::GetLoadResponse response;
  response.set_queued(load.queued);
  response.set_running(load.running);
  response.set_cache_blocks_used(load.cache_blocks_used);
  response.set_cache_blocks_capacity(load.cache_blocks_capacity);
  response.set_retained_sequences(load.retained_sequences);
  for (const IndexerWorkerLoad& w : load.indexer_workers) {
    cv1::WorkerLoad* worker = response.add_indexer_workers();
    worker->set_address(w.address);
    worker->set_cache_blocks_used(w.cache_blocks_used);
    worker->set_cache_blocks_capacity(w.cache_blocks_capacity);
    worker->set_sequences(w.sequences);
    worker->set_ready(w.ready);
    worker->set_reachable(w.reachable);
    worker->set_unreached_for_ms(w.unreached_for_ms);
  }
  for (const AttentionWorkerLoad& w : load.attention_workers) {
    cv1::AttentionWorkerLoad* worker = response.add_attention_workers();
    worker->set_address(w.address);
    worker->set_ready(w.ready);
    worker->set_decoding(w.decoding);
    worker->set_reachable(w.reachable);
    worker->set_unreached_for_ms(w.unreached_for_ms);
  }
  if (load.model.has_value()) {
    cv1::Model* model = response.mutable_model();
    model->set_name(load.model->name);
    model->set_vocab_size(load.model->vocab_size);
    model->set_eos_token_id(load.model->eos_token_id);
    model->set_max_context(load.model->max_context);
  }
  return response;
}

absl::StatusOr<std::unique_ptr<CoordinatorServiceImpl>> CoordinatorServiceImpl::Create(
    const CoordinatorOptions& options, CoordinatorMetrics* metrics, AddressResolver resolve,
    std::shared_ptr<const BearerTokenAuthenticator> tokens) {
  const int max_backoff_ms = static_cast<int>(
      std::clamp<int64_t>(options.worker_check_interval_ms,
                          std::max<int64_t>(options.worker_check_timeout_ms, 1), int64_t{60000}));
  auto engine = CoordinatorEngine::Create(
      options, metrics, GrpcWorkerClients(options.worker_security, max_backoff_ms), &RealClock(),
      std::move(resolve));
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<CoordinatorServiceImpl>(
      new CoordinatorServiceImpl(*std::move(engine), std::move(tokens)));
}

grpc::Status CoordinatorServiceImpl::Generate(grpc::ServerContext* context,
                                              const cv1::GenerateRequest* request,
                                              grpc::ServerWriter<cv1::GenerateEvent>* writer) {
  std::string traceparent;
  if (auto it = context->client_metadata().find(kTraceparentKey);
      it != context->client_metadata().end()) {
    traceparent.assign(it->second.data(), it->second.size());
  }
  GrpcGenerateStream stream(*context, *writer);
  return ToGrpcStatus(engine_->Generate(
      ToGenerateSpec(*request), TenantIdentity(*context, tokens_.get()), traceparent, stream));
}

grpc::Status CoordinatorServiceImpl::Abort(grpc::ServerContext* context,
                                           const cv1::AbortRequest* request,
                                           cv1::AbortResponse* /*response*/) {
  return ToGrpcStatus(
      engine_->Abort(request->request_id(), TenantIdentity(*context, tokens_.get())));
}

grpc::Status CoordinatorServiceImpl::GetLoad(grpc::ServerContext* /*context*/,
                                             const cv1::GetLoadRequest* /*request*/,
                                             cv1::GetLoadResponse* response) {
  *response = ToGetLoadResponse(engine_->GetLoad());
  return grpc::Status::OK;
}

}  // namespace dsa
