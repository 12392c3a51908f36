// The coordinator service (see service.h).
#include "coordinator/service.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/time.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

constexpr int64_t kMaxSlots = (int64_t{1} << 31) - 1;
// How often a waiting handler looks at its call's cancellation.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

int64_t ContextLength(const cv1::GenerateRequest& request) {
  return request.has_context_tokens() ? request.context_tokens().tokens_size()
                                      : request.context_length();
}

// SplitMix64 finalizer over the seed and an FNV-1a hash of the request id: a per-request
// acceptance seed that is the same in every run.
uint64_t RequestSeed(uint64_t seed, const std::string& request_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : request_id) {
    h = (h ^ c) * 1099511628211ull;
  }
  uint64_t z = seed ^ h;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A worker's status for a request: CANCELLED from a worker (it cancelled the call, e.g. while
// shutting down) means the worker was lost, so UNAVAILABLE (retryable); other codes unchanged.
grpc::Status WorkerStatus(const grpc::Status& status, const std::string& address) {
  if (status.error_code() != grpc::StatusCode::CANCELLED) return status;
  return {
      grpc::StatusCode::UNAVAILABLE,
      absl::StrCat("attention worker ", address, " cancelled the call: ", status.error_message())};
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Retries `call` (one RPC with a deadline) until it succeeds or `deadline` passes.
template <typename Call>
grpc::Status RetryUntil(std::chrono::system_clock::time_point deadline, Call call) {
  grpc::Status status;
  while (true) {
    const auto now = std::chrono::system_clock::now();
    const auto attempt_deadline = std::min(deadline, now + std::chrono::seconds(1));
    status = call(attempt_deadline);
    if (status.ok() || std::chrono::system_clock::now() >= deadline) return status;
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return status;
    }
    std::this_thread::sleep_until(std::min(deadline, now + std::chrono::milliseconds(100)));
  }
}

}  // namespace

absl::Status ValidateGenerateRequest(const cv1::GenerateRequest& request) {
  if (request.request_id().empty() || request.request_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id must be 1..128 bytes, got ", request.request_id().size()));
  }
  if (request.session_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id must be at most 128 bytes, got ", request.session_id().size()));
  }
  int64_t context = 0;
  if (request.has_context_tokens()) {
    context = request.context_tokens().tokens_size();
    if (context < 1) {
      return absl::InvalidArgumentError("context_tokens must hold at least one token");
    }
  } else if (request.context_case() == cv1::GenerateRequest::kContextLength) {
    context = request.context_length();
    if (context < 1) {
      return absl::InvalidArgumentError(absl::StrCat("context_length must be >= 1, got ", context));
    }
  } else {
    return absl::InvalidArgumentError("a context is required (context_length or context_tokens)");
  }
  if (request.max_new_tokens() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1, got ", request.max_new_tokens()));
  }
  if (request.draft_length() < 0 || request.draft_length() > 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft_length must be in 0..4, got ", request.draft_length()));
  }
  if (context > kMaxSlots || request.max_new_tokens() > kMaxSlots ||
      context + request.max_new_tokens() + request.draft_length() > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("context (", context, ") + max_new_tokens (",
                                                   request.max_new_tokens(),
                                                   ") + draft_length must stay below 2^31 slots"));
  }
  const int64_t max_prefix = (context + kSlotsPerPrefixBlock - 1) / kSlotsPerPrefixBlock;
  if (request.prefix_block_ids_size() > max_prefix) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_block_ids holds ", request.prefix_block_ids_size(), " ids; a context of ", context,
        " tokens allows at most ceil(", context, " / 512) = ", max_prefix));
  }
  const cv1::Overrides& o = request.overrides();
  if (o.has_target_block_sparsity() &&
      !(o.target_block_sparsity() >= 0.0 && o.target_block_sparsity() < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overrides.target_block_sparsity must be in [0, 1), got ", o.target_block_sparsity()));
  }
  if (o.has_exploration_fraction() &&
      !(o.exploration_fraction() >= 0.0 && o.exploration_fraction() < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overrides.exploration_fraction must be in [0, 1), got ", o.exploration_fraction()));
  }
  if (o.has_top_k() && o.top_k() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.top_k must be >= 1, got ", o.top_k()));
  }
  if (o.has_acceptance_rate() && !(o.acceptance_rate() >= 0.0 && o.acceptance_rate() <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.acceptance_rate must be in [0, 1], got ", o.acceptance_rate()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorServiceImpl>> CoordinatorServiceImpl::Create(
    const CoordinatorOptions& options, CoordinatorMetrics* metrics) {
  if (options.attention_addresses.empty()) {
    return absl::InvalidArgumentError("no attention worker (--attention)");
  }
  if (options.indexer_addresses.empty()) {
    return absl::InvalidArgumentError("no indexer worker (--indexer)");
  }
  if (options.stall_timeout_ms < 0) {
    return absl::InvalidArgumentError("stall_timeout_ms must be >= 0");
  }
  if (options.max_pending_events < 2) {
    return absl::InvalidArgumentError("max_pending_events must be >= 2");
  }
  if (options.top_k < 1 ||
      !(options.target_block_sparsity >= 0 && options.target_block_sparsity < 1) ||
      !(options.exploration_fraction >= 0 && options.exploration_fraction < 1)) {
    return absl::InvalidArgumentError(
        "top_k must be >= 1, target_block_sparsity and exploration_fraction in [0, 1)");
  }
  if (!AcceptanceModel::Create(options.acceptance_rate, 0, 0).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("acceptance_rate must be in [0, 1], got ", options.acceptance_rate));
  }
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics are required");
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(options.startup_timeout_ms);

  std::vector<AttentionWorkerInfo> attention_info;
  std::vector<av1::GetInfoResponse> infos;
  for (const std::string& address : options.attention_addresses) {
    auto stub = av1::AttentionService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    av1::GetInfoResponse info;
    const grpc::Status status = RetryUntil(deadline, [&](auto attempt_deadline) {
      grpc::ClientContext context;
      context.set_deadline(attempt_deadline);
      context.set_wait_for_ready(true);
      return stub->GetInfo(&context, av1::GetInfoRequest(), &info);
    });
    if (!status.ok()) {
      return absl::Status(
          static_cast<absl::StatusCode>(status.error_code()),
          absl::StrCat("attention worker ", address, " did not answer GetInfo within ",
                       options.startup_timeout_ms, " ms: ", status.error_message()));
    }
    if (!infos.empty() && info.num_full_layers() != infos.front().num_full_layers()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attention workers disagree on the number of full layers: ",
          options.attention_addresses.front(), " has ", infos.front().num_full_layers(), ", ",
          address, " has ", info.num_full_layers()));
    }
    if (info.num_full_layers() < 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("attention worker ", address, " reports no full layer"));
    }
    infos.push_back(info);
    attention_info.push_back({address, info.kv_capacity_slots()});
  }
  std::vector<IndexerWorkerInfo> indexer_info;
  for (const std::string& address : options.indexer_addresses) {
    auto stub = iv1::IndexerService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    iv1::GetLoadResponse load;
    const grpc::Status status = RetryUntil(deadline, [&](auto attempt_deadline) {
      grpc::ClientContext context;
      context.set_deadline(attempt_deadline);
      context.set_wait_for_ready(true);
      return stub->GetLoad(&context, iv1::GetLoadRequest(), &load);
    });
    if (!status.ok()) {
      return absl::Status(
          static_cast<absl::StatusCode>(status.error_code()),
          absl::StrCat("indexer worker ", address, " did not answer GetLoad within ",
                       options.startup_timeout_ms, " ms: ", status.error_message()));
    }
    for (size_t j = 0; j < infos.size(); ++j) {
      if (infos[j].num_heads() != load.num_heads() || infos[j].head_dim() != load.head_dim()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "indexer worker ", address, " has H = ", load.num_heads(), ", D = ", load.head_dim(),
            " but attention worker ", options.attention_addresses[j],
            " has H = ", infos[j].num_heads(), ", D = ", infos[j].head_dim()));
      }
    }
    indexer_info.push_back({address, load.capacity_blocks()});
  }

  SchedulerOptions scheduler_options;
  scheduler_options.num_full_layers = infos.front().num_full_layers();
  scheduler_options.max_queue = options.max_queue;
  scheduler_options.max_running_per_attention = options.max_running_per_attention;
  scheduler_options.retain_finished = options.retain_finished;
  scheduler_options.colocated = options.colocated;
  // Sequence ids unique across coordinator restarts with high probability: a random start below
  // 2^62, counting up.
  absl::BitGen gen;
  scheduler_options.first_sequence_id = absl::Uniform<uint64_t>(gen, 1, uint64_t{1} << 62);
  auto scheduler = Scheduler::Create(scheduler_options, indexer_info, attention_info);
  if (!scheduler.ok()) return scheduler.status();
  return std::unique_ptr<CoordinatorServiceImpl>(new CoordinatorServiceImpl(
      options, metrics, scheduler_options.num_full_layers, *std::move(scheduler)));
}

CoordinatorServiceImpl::CoordinatorServiceImpl(const CoordinatorOptions& options,
                                               CoordinatorMetrics* metrics, int num_full_layers,
                                               Scheduler scheduler)
    : options_(options),
      metrics_(metrics),
      num_full_layers_(num_full_layers),
      scheduler_(std::move(scheduler)) {
  for (const std::string& address : options_.indexer_addresses) {
    indexers_.push_back({address, iv1::IndexerService::NewStub(grpc::CreateChannel(
                                      address, grpc::InsecureChannelCredentials()))});
  }
  for (const std::string& address : options_.attention_addresses) {
    auto worker = std::make_unique<AttentionWorker>();
    worker->address = address;
    worker->stub = av1::AttentionService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    attention_.push_back(std::move(worker));
  }
  for (int j = 0; j < static_cast<int>(attention_.size()); ++j) {
    attention_[j]->loop = std::thread([this, j] { DecodeLoop(j); });
  }
}

CoordinatorServiceImpl::~CoordinatorServiceImpl() { Stop(); }

void CoordinatorServiceImpl::Stop() {
  if (stopped_.exchange(true)) return;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& worker : attention_) worker->wake.SignalAll();
  }
  for (auto& worker : attention_) {
    if (worker->loop.joinable()) worker->loop.join();
  }
}

void CoordinatorServiceImpl::StartDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  for (uint64_t ticket : scheduler_.CancelAllQueued()) {
    auto it = by_ticket_.find(ticket);
    if (it == by_ticket_.end()) continue;
    it->second->phase = Phase::kEnded;
    SetFinalLocked(*it->second, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                             "draining: the coordinator is shutting down"));
  }
  UpdateGaugesLocked();
}

std::chrono::system_clock::time_point CoordinatorServiceImpl::RpcDeadline() const {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(options_.rpc_timeout_ms);
}

void CoordinatorServiceImpl::SetFinalLocked(Request& request, const grpc::Status& status) {
  if (request.final_status.has_value()) return;
  request.final_status = status;
  RequestOutcome outcome = RequestOutcome::kFailed;
  if (status.ok()) {
    outcome = RequestOutcome::kCompleted;
  } else if (status.error_code() == grpc::StatusCode::CANCELLED) {
    outcome = RequestOutcome::kCancelled;
  }
  metrics_->CountRequest(outcome);
  request.changed.SignalAll();
}

void CoordinatorServiceImpl::UpdateGaugesLocked() {
  const SchedulerLoad load = scheduler_.Load();
  metrics_->SetQueued(load.queued);
  metrics_->SetRunning(load.running);
}

void CoordinatorServiceImpl::AbortLocked(Request& request) {
  if (request.final_status.has_value() || request.cancel_requested) return;
  request.cancel_requested = true;
  if (request.phase == Phase::kQueued) {
    scheduler_.CancelQueued(request.ticket);
    request.phase = Phase::kEnded;
    SetFinalLocked(request, grpc::Status(grpc::StatusCode::CANCELLED, "aborted while queued"));
    // The head may have left: the next ones may fit now.
    if (!draining_) DeliverAdmissionsLocked(scheduler_.AdmitQueued());
    UpdateGaugesLocked();
  } else if (request.phase == Phase::kDecoding && request.admission.has_value()) {
    attention_[request.admission->attention]->wake.Signal();
  }
  request.changed.SignalAll();
}

void CoordinatorServiceImpl::DeliverAdmissionsLocked(std::vector<Admission> admissions) {
  for (Admission& admission : admissions) {
    auto it = by_ticket_.find(admission.ticket);
    if (it == by_ticket_.end()) continue;  // cannot happen: tickets leave the queue first
    Request& request = *it->second;
    request.admission = std::move(admission);
    request.phase = Phase::kPrefilling;
    request.changed.SignalAll();
  }
  UpdateGaugesLocked();
}

void CoordinatorServiceImpl::CarryOutEvictions(const std::vector<Eviction>& evictions) {
  for (const Eviction& eviction : evictions) {
    grpc::ClientContext context;
    context.set_deadline(RpcDeadline());
    grpc::Status status;
    if (eviction.release_on_attention) {
      av1::ReleaseRequest request;
      request.set_sequence_id(eviction.sequence_id);
      av1::ReleaseResponse response;
      status = attention_[eviction.attention]->stub->Release(&context, request, &response);
    } else {
      iv1::ReleaseRequest request;
      request.set_sequence_id(eviction.sequence_id);
      iv1::ReleaseResponse response;
      status = indexers_[eviction.indexer].stub->Release(&context, request, &response);
    }
    (void)status;  // a worker that lost the sequence already freed it
  }
}

grpc::Status CoordinatorServiceImpl::Prefill(grpc::ServerContext* context, const Request& request,
                                             const Admission& admission,
                                             av1::PrefillResponse* response) {
  const cv1::GenerateRequest& g = request.proto;
  const cv1::Overrides& o = g.overrides();
  av1::PrefillRequest prefill;
  prefill.set_sequence_id(admission.sequence_id);
  prefill.set_context_length(request.demand.context_length);
  for (uint64_t id : g.prefix_block_ids()) prefill.add_prefix_block_ids(id);
  prefill.set_indexer_worker(indexers_[admission.indexer].address);
  av1::SequenceSettings* settings = prefill.mutable_settings();
  settings->set_top_k(o.has_top_k() ? o.top_k() : options_.top_k);
  iv1::SpinSettings* spin = settings->mutable_spin();
  if (o.has_all_keep() ? o.all_keep() : options_.all_keep) {
    spin->set_all_keep(true);
  } else {
    spin->set_target_block_sparsity(o.has_target_block_sparsity() ? o.target_block_sparsity()
                                                                  : options_.target_block_sparsity);
  }
  spin->set_exploration_fraction(o.has_exploration_fraction() ? o.exploration_fraction()
                                                              : options_.exploration_fraction);
  spin->set_seed(options_.seed);
  if (admission.prefix_source_id.has_value()) {
    prefill.set_prefix_source_id(*admission.prefix_source_id);
    prefill.set_prefix_slots(admission.prefix_slots);
  }
  prefill.set_continue_sequence(admission.continue_sequence);
  // Cancelled with the Generate call (client gone, server shutdown).
  std::unique_ptr<grpc::ClientContext> client = grpc::ClientContext::FromServerContext(*context);
  return attention_[admission.attention]->stub->Prefill(client.get(), prefill, response);
}

grpc::Status CoordinatorServiceImpl::Generate(grpc::ServerContext* context,
                                              const cv1::GenerateRequest* proto,
                                              grpc::ServerWriter<cv1::GenerateEvent>* writer) {
  const Clock::time_point arrival = Clock::now();
  if (absl::Status valid = ValidateGenerateRequest(*proto); !valid.ok()) {
    metrics_->CountRequest(RequestOutcome::kRejected);
    return ToGrpc(valid);
  }
  auto request = std::make_shared<Request>();
  request->id = proto->request_id();
  request->proto = *proto;
  request->arrival = arrival;
  request->demand.context_length = ContextLength(*proto);
  request->demand.max_new_tokens = proto->max_new_tokens();
  request->demand.draft_length = proto->draft_length();
  request->demand.prefix_block_ids.assign(proto->prefix_block_ids().begin(),
                                          proto->prefix_block_ids().end());
  request->demand.session_id = proto->session_id();
  const double acceptance_rate = proto->overrides().has_acceptance_rate()
                                     ? proto->overrides().acceptance_rate()
                                     : options_.acceptance_rate;
  request->acceptance = *AcceptanceModel::Create(acceptance_rate, proto->draft_length(),
                                                 RequestSeed(options_.seed, proto->request_id()));

  {
    absl::MutexLock lock(&mu_);
    if (draining_ || stopping_) {
      metrics_->CountRequest(RequestOutcome::kRejected);
      return {grpc::StatusCode::UNAVAILABLE, "draining: the coordinator admits no new requests"};
    }
    if (by_id_.contains(request->id)) {
      metrics_->CountRequest(RequestOutcome::kRejected);
      return {grpc::StatusCode::ALREADY_EXISTS,
              absl::StrCat("request '", request->id, "' is already in flight")};
    }
    request->ticket = next_ticket_++;
    absl::StatusOr<std::optional<Admission>> submitted =
        scheduler_.Submit(request->ticket, request->demand);
    if (!submitted.ok()) {
      metrics_->CountRequest(RequestOutcome::kRejected);
      return ToGrpc(submitted.status());
    }
    by_id_[request->id] = request;
    by_ticket_[request->ticket] = request;
    request->server_context = context;
    if (submitted->has_value()) {
      request->admission = **std::move(submitted);
      request->phase = Phase::kPrefilling;
    }
    UpdateGaugesLocked();
  }

  // Removes the request from the in-flight maps when the handler returns.
  struct Unregister {
    CoordinatorServiceImpl* self;
    const std::shared_ptr<Request>& request;
    ~Unregister() {
      absl::MutexLock lock(&self->mu_);
      request->server_context = nullptr;
      self->by_id_.erase(request->id);
      self->by_ticket_.erase(request->ticket);
    }
  } unregister{this, request};

  // Wait for admission (or the end while queued).
  Admission admission;
  {
    absl::MutexLock lock(&mu_);
    while (!request->admission.has_value() && !request->final_status.has_value()) {
      request->changed.WaitWithTimeout(&mu_, kCancelPoll);
      if (context->IsCancelled()) AbortLocked(*request);
    }
    if (request->final_status.has_value()) return *request->final_status;
    admission = *request->admission;
  }
  const Clock::time_point admitted_at = Clock::now();
  metrics_->ObserveQueueDuration(Seconds(admitted_at - arrival));

  CarryOutEvictions(admission.evictions);
  av1::PrefillResponse prefilled;
  const grpc::Status prefill_status = Prefill(context, *request, admission, &prefilled);
  std::vector<Eviction> unpinned;
  bool decoding = false;
  {
    absl::MutexLock lock(&mu_);
    if (prefill_status.ok() && !request->cancel_requested && !context->IsCancelled()) {
      unpinned = scheduler_.PrefillDone(admission.sequence_id);
      request->phase = Phase::kDecoding;
      decoding = true;
      attention_[admission.attention]->decoding.push_back(request);
      attention_[admission.attention]->wake.Signal();
    }
  }
  if (admission.prefix_source_id.has_value()) {
    // The donor is unpinned (evictable, or released now): queued requests may fit.
    CarryOutEvictions(unpinned);
    absl::MutexLock lock(&mu_);
    if (!draining_) DeliverAdmissionsLocked(scheduler_.AdmitQueued());
  }
  if (!decoding) {
    // Failed or cancelled during the prefill: a failed prefill leaves nothing on the workers, a
    // cancelled successful one is released by EndSequence.
    const grpc::Status status =
        prefill_status.ok() ? grpc::Status(grpc::StatusCode::CANCELLED, "aborted during prefill")
                            : prefill_status;
    EndSequence(request, status, /*completed=*/false);
    absl::MutexLock lock(&mu_);
    return *request->final_status;
  }

  cv1::GenerateEvent admitted_event;
  cv1::Admitted* admitted = admitted_event.mutable_admitted();
  admitted->set_queue_seconds(Seconds(admitted_at - arrival));
  admitted->set_indexer_worker(indexers_[admission.indexer].address);
  admitted->set_attention_worker(attention_[admission.attention]->address);
  admitted->set_prefix_slots_reused(admission.prefix_source_id.has_value() ? admission.prefix_slots
                                                                           : 0);
  admitted->set_prefill_seconds(prefilled.seconds());
  bool writable = writer->Write(admitted_event);

  while (true) {
    cv1::GenerateEvent event;
    {
      absl::MutexLock lock(&mu_);
      if (!writable) AbortLocked(*request);
      while (request->events.empty() && !request->final_status.has_value()) {
        request->changed.WaitWithTimeout(&mu_, kCancelPoll);
        if (context->IsCancelled()) AbortLocked(*request);
      }
      if (request->events.empty()) return *request->final_status;
      event = std::move(request->events.front());
      request->events.pop_front();
      attention_[admission.attention]->wake.Signal();  // room in the queue
    }
    if (writable) writable = writer->Write(event);
  }
}

grpc::Status CoordinatorServiceImpl::Abort(grpc::ServerContext* context,
                                           const cv1::AbortRequest* request,
                                           cv1::AbortResponse* response) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(request->request_id());
  if (it == by_id_.end() || it->second->final_status.has_value()) {
    return {grpc::StatusCode::NOT_FOUND,
            absl::StrCat("no request '", request->request_id(), "' in flight")};
  }
  AbortLocked(*it->second);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::GetLoad(grpc::ServerContext* context,
                                             const cv1::GetLoadRequest* request,
                                             cv1::GetLoadResponse* response) {
  SchedulerLoad load;
  {
    absl::MutexLock lock(&mu_);
    load = scheduler_.Load();
  }
  response->set_queued(load.queued);
  response->set_running(load.running);
  response->set_retained_sequences(load.retained);
  int64_t used = 0;
  int64_t capacity = 0;
  for (size_t i = 0; i < indexers_.size(); ++i) {
    cv1::WorkerLoad* worker = response->add_indexer_workers();
    worker->set_address(indexers_[i].address);
    grpc::ClientContext client;
    client.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    iv1::GetLoadResponse indexer_load;
    if (indexers_[i].stub->GetLoad(&client, iv1::GetLoadRequest(), &indexer_load).ok()) {
      worker->set_cache_blocks_used(indexer_load.used_blocks());
      worker->set_cache_blocks_capacity(indexer_load.capacity_blocks());
      worker->set_sequences(static_cast<int32_t>(indexer_load.sequences()));
    } else {
      worker->set_cache_blocks_used(load.indexers[i].used_blocks);
      worker->set_cache_blocks_capacity(load.indexers[i].capacity_blocks);
      worker->set_sequences(load.indexers[i].sequences);
    }
    used += worker->cache_blocks_used();
    capacity += worker->cache_blocks_capacity();
  }
  response->set_cache_blocks_used(used);
  response->set_cache_blocks_capacity(capacity);
  return grpc::Status::OK;
}

void CoordinatorServiceImpl::EndSequence(const std::shared_ptr<Request>& request,
                                         const grpc::Status& status, bool completed) {
  Scheduler::FinishResult finish;
  uint64_t sequence_id = 0;
  int attention = 0;
  grpc::Status final_status = status;
  {
    absl::MutexLock lock(&mu_);
    const Admission& admission = *request->admission;
    sequence_id = admission.sequence_id;
    attention = admission.attention;
    auto& decoding = attention_[attention]->decoding;
    decoding.erase(std::remove(decoding.begin(), decoding.end(), request), decoding.end());
    const int64_t length = request->demand.context_length + request->generated;
    finish = scheduler_.Finish(sequence_id, completed, length);
    request->phase = Phase::kEnded;
    if (request->cancel_requested && !completed) {
      final_status = grpc::Status(grpc::StatusCode::CANCELLED, request->cancel_reason);
    }
    UpdateGaugesLocked();
  }
  std::vector<Eviction> evictions = std::move(finish.evictions);
  if (finish.release_attention) {
    grpc::ClientContext context;
    context.set_deadline(RpcDeadline());
    av1::ReleaseRequest release;
    release.set_sequence_id(sequence_id);
    release.set_keep_indexer_sequence(finish.keep_indexer_sequence);
    av1::ReleaseResponse released;
    // NOT_FOUND after a failed prefill (it leaves nothing behind) is expected.
    (void)attention_[attention]->stub->Release(&context, release, &released);
    absl::MutexLock lock(&mu_);
    std::vector<Eviction> more = scheduler_.ReleaseDone(sequence_id);
    evictions.insert(evictions.end(), more.begin(), more.end());
  }
  CarryOutEvictions(evictions);
  absl::MutexLock lock(&mu_);
  // The stream ends only now, so that a client that saw it end finds the space accounted free
  // (or the sequence retained) in GetLoad and in its next request's placement.
  SetFinalLocked(*request, final_status);
  if (!draining_) DeliverAdmissionsLocked(scheduler_.AdmitQueued());
  UpdateGaugesLocked();
}

CoordinatorServiceImpl::StepOutcome CoordinatorServiceImpl::RunStep(
    int worker, const std::vector<std::shared_ptr<Request>>& batch, const std::vector<int>& rows) {
  StepOutcome outcome;
  av1::DecodeStepRequest step;
  for (size_t i = 0; i < batch.size(); ++i) {
    av1::SequenceStep* s = step.add_sequences();
    s->set_sequence_id(batch[i]->admission->sequence_id);
    s->set_rows(rows[i]);
  }
  grpc::ClientContext context;
  context.set_deadline(RpcDeadline());
  const Clock::time_point start = Clock::now();
  outcome.status =
      WorkerStatus(attention_[worker]->stub->DecodeStep(&context, step, &outcome.response),
                   attention_[worker]->address);
  outcome.seconds = Seconds(Clock::now() - start);
  if (outcome.status.ok() && outcome.response.sequences_size() != static_cast<int>(batch.size())) {
    outcome.status = grpc::Status(grpc::StatusCode::INTERNAL,
                                  absl::StrCat("attention worker ", attention_[worker]->address,
                                               " answered ", outcome.response.sequences_size(),
                                               " results for ", batch.size(), " sequences"));
  }
  return outcome;
}

void CoordinatorServiceImpl::ApplyStep(int worker,
                                       const std::vector<std::shared_ptr<Request>>& batch,
                                       const std::vector<int>& rows, const StepOutcome& outcome) {
  // Speculative sequences: draw the accepted counts and commit them all concurrently.
  const size_t n = batch.size();
  std::vector<int> accepted(n, 0);
  std::vector<grpc::Status> committed(n);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
  std::vector<av1::CommitRequest> commits(n);
  std::vector<av1::CommitResponse> responses(n);
  int num_commits = 0;
  for (size_t i = 0; i < n; ++i) num_commits += rows[i] > 1 ? 1 : 0;
  absl::BlockingCounter pending(num_commits);
  for (size_t i = 0; i < n; ++i) {
    if (rows[i] <= 1) continue;
    Request& request = *batch[i];
    accepted[i] = std::min(request.acceptance->Accepted(request.verification_steps++), rows[i] - 1);
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(RpcDeadline());
    commits[i].set_sequence_id(request.admission->sequence_id);
    commits[i].set_accepted(accepted[i]);
    attention_[worker]->stub->async()->Commit(contexts[i].get(), &commits[i], &responses[i],
                                              [&committed, &pending, i](grpc::Status status) {
                                                committed[i] = std::move(status);
                                                pending.DecrementCount();
                                              });
  }
  if (num_commits > 0) pending.Wait();
  for (size_t i = 0; i < n; ++i) {
    const grpc::Status status = WorkerStatus(committed[i], attention_[worker]->address);
    if (!status.ok()) {
      EndSequence(batch[i], status, /*completed=*/false);
      continue;
    }
    AdvanceSequence(batch[i], rows[i], accepted[i], outcome.response.sequences(i), outcome.response,
                    outcome.seconds);
  }
}

void CoordinatorServiceImpl::AdvanceSequence(const std::shared_ptr<Request>& request, int rows,
                                             int accepted, const av1::SequenceStepResult& result,
                                             const av1::DecodeStepResponse& response,
                                             double seconds) {
  if (rows > 1) metrics_->CountSpeculativeStep(rows - 1, accepted);
  const int count = accepted + 1;
  const Clock::time_point now = Clock::now();
  if (request->generated == 0) {
    request->first_token_time = now;
    request->first_count = count;
    metrics_->ObserveTimeToFirstToken(Seconds(now - request->arrival));
  } else {
    metrics_->ObserveInterTokenLatency(Seconds(now - request->last_step_time) / count);
  }
  request->last_step_time = now;
  request->generated += count;

  cv1::GenerateEvent event;
  cv1::Tokens* tokens = event.mutable_tokens();
  tokens->set_first_position(result.first_position());
  tokens->set_count(count);
  tokens->set_drafted(rows - 1);
  tokens->set_accepted(accepted);
  tokens->set_step_seconds(seconds);
  tokens->set_blocks_scored(result.blocks_scored());
  tokens->set_blocks_visible(result.blocks_visible());
  tokens->set_audited_rows(result.audited_rows());
  tokens->set_audit_miss_rate_sum(result.audit_miss_rate_sum());
  for (double wait : response.selection_wait_seconds()) tokens->add_selection_wait_seconds(wait);
  const bool done = request->generated >= request->demand.max_new_tokens;
  {
    absl::MutexLock lock(&mu_);
    request->events.push_back(std::move(event));
    if (done) {
      cv1::GenerateEvent finished_event;
      cv1::Finished* finished = finished_event.mutable_finished();
      finished->set_generated_tokens(request->generated);
      finished->set_time_to_first_token_seconds(
          Seconds(request->first_token_time - request->arrival));
      const int64_t later = request->generated - request->first_count;
      finished->set_mean_inter_token_latency_seconds(
          later > 0 ? Seconds(request->last_step_time - request->first_token_time) /
                          static_cast<double>(later)
                    : 0.0);
      request->events.push_back(std::move(finished_event));
    }
    request->changed.SignalAll();
  }
  if (done) EndSequence(request, grpc::Status::OK, /*completed=*/true);
}

void CoordinatorServiceImpl::DecodeLoop(int worker) {
  AttentionWorker& w = *attention_[worker];
  const size_t room = static_cast<size_t>(options_.max_pending_events) - 2;
  while (true) {
    std::vector<std::shared_ptr<Request>> batch;
    std::vector<int> rows;
    std::vector<std::shared_ptr<Request>> cancelled;
    {
      absl::MutexLock lock(&mu_);
      while (true) {
        if (stopping_) return;
        bool stalled = false;
        const Clock::time_point now = Clock::now();
        for (const auto& request : w.decoding) {
          if (request->cancel_requested) {
            cancelled.push_back(request);
          } else if (request->events.size() <= room) {
            request->stalled_since.reset();
            batch.push_back(request);
            const int64_t left = request->demand.max_new_tokens - request->generated;
            rows.push_back(
                static_cast<int>(std::min<int64_t>(request->demand.draft_length + 1, left)));
          } else if (options_.stall_timeout_ms > 0) {
            // The reader has not taken its events: after the stall timeout, end the request.
            if (!request->stalled_since.has_value()) request->stalled_since = now;
            if (now - *request->stalled_since >=
                std::chrono::milliseconds(options_.stall_timeout_ms)) {
              request->cancel_reason = absl::StrCat(
                  "the client left ", request->events.size(), " events unread for ",
                  options_.stall_timeout_ms, " ms (--stall-timeout-ms); request ended");
              request->cancel_requested = true;
              if (request->server_context != nullptr) request->server_context->TryCancel();
              request->changed.SignalAll();
              cancelled.push_back(request);
            } else {
              stalled = true;
            }
          }
        }
        if (!batch.empty() || !cancelled.empty()) break;
        if (stalled) {
          w.wake.WaitWithTimeout(&mu_, absl::Milliseconds(100));  // to see the timeout pass
        } else {
          w.wake.Wait(&mu_);
        }
      }
    }
    for (const auto& request : cancelled) {
      EndSequence(request, grpc::Status(grpc::StatusCode::CANCELLED, request->cancel_reason),
                  false);
    }
    if (batch.empty()) continue;
    StepOutcome outcome = RunStep(worker, batch, rows);
    if (outcome.status.ok()) {
      ApplyStep(worker, batch, rows, outcome);
      continue;
    }
    // The batch failed; sequences the attention worker rolled back can go on: find the failing
    // ones by stepping each alone (a sequence it marked broken fails again, FAILED_PRECONDITION),
    // unless the worker hung (a deadline): then retrying one by one would only multiply the wait.
    const bool hung = outcome.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    for (size_t i = 0; i < batch.size(); ++i) {
      StepOutcome alone =
          batch.size() == 1 || hung ? outcome : RunStep(worker, {batch[i]}, {rows[i]});
      if (alone.status.ok()) {
        ApplyStep(worker, {batch[i]}, {rows[i]}, alone);
      } else {
        EndSequence(batch[i], alone.status, /*completed=*/false);
      }
    }
  }
}

}  // namespace dsa
