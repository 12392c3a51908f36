// The coordinator's engine (see engine.h).
#include "coordinator/engine.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "coordinator/decode_loops.h"
#include "coordinator/token_blocks.h"
#include "coordinator/worker_pool.h"
#include "server/server.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

constexpr int64_t kMaxSlots = (int64_t{1} << 31) - 1;
// How often a waiting handler looks at its call's cancellation.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

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

// Whether a sequence that failed with `status` may migrate: the codes of a worker's failure
// (CoordinatorEngine's class comment), not a refusal of the request itself. `creating`: the
// status answers the Prefill that creates the sequence (not a session's next turn).
//
// FAILED_PRECONDITION is a worker's failure only for a sequence the workers hold: the attention
// worker marked it broken (another sequence's failure came after its indexer had advanced it),
// and a fresh prefill elsewhere mends that. From the Prefill that creates a sequence it cannot
// mean that, since nothing of the sequence existed: it is a worker that answered refusing the
// request's settings, e.g. an indexer without audits (--audit-fraction 0) refusing a miss target
// (overrides.miss_target), or a refusal of the pair itself (an indexer restarted with another H or
// D since the coordinator last checked it; the next worker check takes the pair out). Such a
// refusal follows from the workers' flags, which a deployment's workers share, so every worker
// would answer the same, and the request ends at once with it. Where the indexers' flags differ
// (some audit, some not) another one might have taken the request; it ends all the same, with the
// refusing workers named, so that the mismatch shows instead of hiding behind migrations that
// succeed or not as placement happens to fall.
bool WorkerFailure(const absl::Status& status, bool creating) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kNotFound:
      return true;
    case absl::StatusCode::kFailedPrecondition:
      return !creating;
    default:
      return false;
  }
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// The first id of `ids` outside [0, limit) (limit 0: no upper bound), as "field[i] = v" with why.
std::optional<std::string> IdOutOfRange(const google::protobuf::RepeatedField<int32_t>& ids,
                                        absl::string_view field, int64_t limit,
                                        absl::string_view model) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      return absl::StrCat(field, "[", i, "] = ", ids[i], ": token ids must be >= 0");
    }
    if (limit > 0 && ids[i] >= limit) {
      return absl::StrCat(field, "[", i, "] = ", ids[i], " is outside the vocabulary [0, ", limit,
                          ") of model '", model, "'");
    }
  }
  return std::nullopt;
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
    if (auto bad = IdOutOfRange(request.context_tokens().tokens(), "context_tokens.tokens", 0, "");
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
    if (request.prefix_block_ids_size() > 0) {
      return absl::InvalidArgumentError(
          "prefix_block_ids must be empty with context_tokens: the coordinator derives the prefix "
          "block ids from the tokens");
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
  if (request.draft_length() < 0 || request.draft_length() > kMaxDraftLength) {
    return absl::InvalidArgumentError(absl::StrCat("draft_length must be in 0..", kMaxDraftLength,
                                                   ", got ", request.draft_length()));
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
  if (o.has_top_k() && (o.top_k() < 1 || o.top_k() > kMaxTopK)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.top_k must be in [1, ", kMaxTopK, "] (kMaxTopK), got ", o.top_k()));
  }
  if (o.has_acceptance_rate() && !(o.acceptance_rate() >= 0.0 && o.acceptance_rate() <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.acceptance_rate must be in [0, 1], got ", o.acceptance_rate()));
  }
  if (o.has_miss_target() && !(o.miss_target() >= 0.0 && o.miss_target() < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.miss_target must be in [0, 1), got ", o.miss_target()));
  }
  const cv1::SamplingParams& sampling = request.sampling();
  if (!(sampling.temperature() == 0.0f ||
        (sampling.temperature() > 0.0f && sampling.temperature() <= 100.0f))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.temperature must be 0 (greedy) or in (0, 100], got ", sampling.temperature()));
  }
  if (!(sampling.top_p() >= 0.0f && sampling.top_p() <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in (0, 1] (0 means 1), got ", sampling.top_p()));
  }
  if (request.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids holds ",
                                                   request.stop_token_ids_size(), " ids; at most ",
                                                   kMaxStopTokenIds));
  }
  if (auto bad = IdOutOfRange(request.stop_token_ids(), "stop_token_ids", 0, ""); bad.has_value()) {
    return absl::InvalidArgumentError(*bad);
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerateRequestForModel(const cv1::GenerateRequest& request,
                                             const ServedModel& model) {
  if (model.real()) {
    if (!request.has_context_tokens()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model '", model.name,
                       "' generates real tokens: the request needs context_tokens "
                       "(context_length alone is for the synthetic pattern model)"));
    }
    if (auto bad = IdOutOfRange(request.context_tokens().tokens(), "context_tokens.tokens",
                                model.vocab_size, model.name);
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
    if (auto bad =
            IdOutOfRange(request.stop_token_ids(), "stop_token_ids", model.vocab_size, model.name);
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
  }
  const int64_t context = ContextLength(request);
  if (model.max_context > 0 && context + request.max_new_tokens() > model.max_context) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "context (", context, " tokens) + max_new_tokens (", request.max_new_tokens(),
        ") = ", context + request.max_new_tokens(), " tokens exceed the max_context of model '",
        model.name, "' (", model.max_context, " tokens)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorEngine>> CoordinatorEngine::Create(
    const CoordinatorOptions& options, CoordinatorMetrics* metrics,
    std::shared_ptr<WorkerClientFactory> workers, const Clock* clock, AddressResolver resolve) {
  if (options.attention_addresses.empty() && options.attention_dns.empty()) {
    return absl::InvalidArgumentError("no attention worker (--attention or --attention-dns)");
  }
  if (options.colocated) {
    if (!options.indexer_dns.empty()) {
      return absl::InvalidArgumentError(
          "co-located indexers are the attention workers: give no --indexer-dns");
    }
    if (!options.indexer_addresses.empty() &&
        options.indexer_addresses != options.attention_addresses) {
      return absl::InvalidArgumentError(
          "co-located indexers are the attention workers: --indexer must list the --attention "
          "addresses in the same order, or be left out");
    }
  } else if (options.indexer_addresses.empty() && options.indexer_dns.empty()) {
    return absl::InvalidArgumentError("no indexer worker (--indexer or --indexer-dns)");
  }
  if (options.stall_timeout_ms < 0) {
    return absl::InvalidArgumentError("stall_timeout_ms must be >= 0");
  }
  if (options.load_cache_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_cache_ms must be >= 0, got ", options.load_cache_ms));
  }
  if (options.worker_check_interval_ms < 0 || options.worker_check_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "worker_check_interval_ms must be >= 0 and worker_check_timeout_ms >= 1");
  }
  if (options.max_migrations < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_migrations must be >= 0, got ", options.max_migrations));
  }
  if (options.hung_worker_checks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hung_worker_checks must be >= 0, got ", options.hung_worker_checks));
  }
  if (options.max_pending_events < 2) {
    return absl::InvalidArgumentError("max_pending_events must be >= 2");
  }
  if (options.top_k < 1 || options.top_k > kMaxTopK ||
      !(options.target_block_sparsity >= 0 && options.target_block_sparsity < 1) ||
      !(options.exploration_fraction >= 0 && options.exploration_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be in [1, ", kMaxTopK,
                                                   "], target_block_sparsity and "
                                                   "exploration_fraction in [0, 1)"));
  }
  // A decode step's select to one indexer worker carries every running sequence of an attention
  // worker at most: its answer must fit a message (common/limits.h) at the largest rows and K.
  if (options.max_running_per_attention < 1 ||
      kSelectResponseFramingBytes + int64_t{options.max_running_per_attention} *
                                        SelectResponseBytesBound(kMaxStepRows, kMaxTopK) >
          kMaxReceiveMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_running_per_attention must be in [1, ",
                     (kMaxReceiveMessageBytes - kSelectResponseFramingBytes) /
                         SelectResponseBytesBound(kMaxStepRows, kMaxTopK),
                     "] (a step's selections must fit the ", kMaxReceiveMessageBytes,
                     "-byte message limit), got ", options.max_running_per_attention));
  }
  if (absl::Status ngram = ValidateNgramDraftOptions(options.ngram); !ngram.ok()) {
    return ngram;
  }
  if (!AcceptanceModel::Create(options.acceptance_rate, 0, 0).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("acceptance_rate must be in [0, 1], got ", options.acceptance_rate));
  }
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics are required");
  if (!resolve) return absl::InvalidArgumentError("an address resolver is required");
  if (workers == nullptr) return absl::InvalidArgumentError("a worker client factory is required");
  if (clock == nullptr) return absl::InvalidArgumentError("a clock is required");
  for (const std::vector<std::string>* list :
       {&options.indexer_addresses, &options.attention_addresses, &options.indexer_dns,
        &options.attention_dns}) {
    for (const std::string& address : *list) {
      if (absl::StatusOr<HostPort> parsed = ParseHostPort(address, /*min_port=*/1); !parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker address: ", parsed.status().message()));
      }
    }
  }

  SchedulerOptions scheduler_options;
  scheduler_options.num_full_layers = 1;  // set from the first attention worker's GetInfo
  scheduler_options.max_queue = options.max_queue;
  scheduler_options.max_running_per_attention = options.max_running_per_attention;
  scheduler_options.retain_finished = options.retain_finished;
  scheduler_options.colocated = options.colocated;
  // Sequence ids drawn at random below 2^62 (unique among those held; across coordinator
  // restarts with high probability), so that a caller who sees one cannot claim the next ones on
  // a worker before the coordinator does. Drawn under the core's mu (every scheduler call is).
  scheduler_options.draw_sequence_id = [gen = std::make_shared<absl::BitGen>()] {
    return absl::Uniform<uint64_t>(*gen, 1, uint64_t{1} << 62);
  };
  auto scheduler = Scheduler::Create(scheduler_options, {}, {});
  if (!scheduler.ok()) return scheduler.status();
  auto engine = std::unique_ptr<CoordinatorEngine>(new CoordinatorEngine(
      options, metrics, std::move(workers), *clock, std::move(resolve), *std::move(scheduler)));
  engine->pool_->RefreshWorkers();
  if (options.run_loops && options.worker_check_interval_ms > 0) {
    engine->watch_ = std::thread([pool = engine->pool_.get()] { pool->WatchWorkers(); });
  }
  if (options.run_loops && options.stall_timeout_ms > 0) {
    engine->stall_watch_ = std::thread([raw = engine.get()] { raw->WatchStalledWrites(); });
  }
  return engine;
}

CoordinatorEngine::CoordinatorEngine(const CoordinatorOptions& options, CoordinatorMetrics* metrics,
                                     std::shared_ptr<WorkerClientFactory> workers,
                                     const Clock& clock, AddressResolver resolve,
                                     Scheduler scheduler)
    : core_(std::make_unique<EngineCore>(options, metrics, clock, std::move(scheduler))),
      pool_(std::make_unique<WorkerPool>(core_.get(), std::move(workers), std::move(resolve))),
      decode_(std::make_unique<DecodeLoops>(core_.get(), pool_.get())) {
  core_->metrics->SetMaxQueued(core_->options.max_queue);
  WorkerPool::Hooks hooks;
  hooks.attention_added = [this](int slot) { decode_->AddWorkerLocked(slot); };
  hooks.refreshed = [this](bool any_became_ready) { WorkersRefreshedLocked(any_became_ready); };
  hooks.after_refresh = [this](const std::vector<Eviction>& evictions) {
    CarryOutEvictions(evictions);
    ReleaseUnreleased();
  };
  pool_->SetHooks(std::move(hooks));
  DecodeLoops::Hooks decode_hooks;
  decode_hooks.end = [this](const std::shared_ptr<InFlightRequest>& request,
                            const absl::Status& status,
                            bool completed) { EndSequence(request, status, completed); };
  decode_hooks.fail = [this](const std::shared_ptr<InFlightRequest>& request,
                             const absl::Status& status) { FailSequence(request, status); };
  decode_->SetHooks(std::move(decode_hooks));
}

CoordinatorEngine::~CoordinatorEngine() { Stop(); }

void CoordinatorEngine::Stop() {
  if (stopped_.exchange(true)) return;
  int num_attention = 0;
  {
    absl::MutexLock lock(&core_->mu);
    core_->stopping = true;
    num_attention = pool_->NumAttentionLocked();
    decode_->WakeAllLocked(num_attention);
    core_->watch_wake.SignalAll();
  }
  if (watch_.joinable()) watch_.join();
  if (stall_watch_.joinable()) stall_watch_.join();
  pool_->WithoutRefreshes([&] {  // no refresh adds a worker from here on
    {
      absl::MutexLock lock(&core_->mu);
      num_attention = pool_->NumAttentionLocked();
    }
    decode_->Join(num_attention);
  });
}

void CoordinatorEngine::WorkersRefreshedLocked(bool any_became_ready) {
  if (any_became_ready && !core_->draining) {
    DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  }
  const std::vector<uint64_t> unplaceable = core_->scheduler.TakeUnplaceableQueued();
  for (uint64_t ticket : unplaceable) {
    auto it = by_ticket_.find(ticket);
    if (it == by_ticket_.end()) continue;
    it->second->phase = RequestPhase::kEnded;
    SetFinalLocked(*it->second,
                   absl::Status(absl::StatusCode::kUnavailable,
                                "no ready worker can hold the request now (the workers large "
                                "enough for it are not ready)"));
  }
  if (!unplaceable.empty()) UpdateGaugesLocked();
}

void CoordinatorEngine::WatchStalledWrites() {
  // A quarter of the timeout between looks (10 ms .. 1 s): a stalled write is cut within 1.25x.
  const absl::Duration period = std::clamp(absl::Milliseconds(core_->options.stall_timeout_ms) / 4,
                                           absl::Milliseconds(10), absl::Seconds(1));
  while (true) {
    {
      absl::MutexLock lock(&core_->mu);
      const absl::Time until = absl::Now() + period;
      while (!core_->stopping && !core_->watch_wake.WaitWithDeadline(&core_->mu, until)) {
      }
      if (core_->stopping) return;
    }
    CheckStalledWrites();
  }
}

void CoordinatorEngine::CheckStalledWrites() {
  if (core_->options.stall_timeout_ms <= 0) return;
  const absl::Duration timeout = absl::Milliseconds(core_->options.stall_timeout_ms);
  absl::MutexLock lock(&core_->mu);
  const absl::Time now = core_->clock.Now();
  for (auto& [key, request] : by_id_) {
    if (!request->write_blocked_since.has_value() || request->stream == nullptr ||
        now - *request->write_blocked_since < timeout) {
      continue;
    }
    LogJson("warn", "ending a stream whose client stopped reading",
            {{"request_id", request->id},
             {"blocked_ms", absl::ToInt64Milliseconds(now - *request->write_blocked_since)},
             {"stall_timeout_ms", core_->options.stall_timeout_ms},
             {"finished", request->final_status.has_value()}});
    if (!request->final_status.has_value() && !request->cancel_requested) {
      request->cancel_reason =
          absl::StrCat("the client read nothing for ", core_->options.stall_timeout_ms,
                       " ms (--stall-timeout-ms); request ended");
      request->cancel_requested = true;
      request->changed.SignalAll();
      if (request->admission.has_value()) decode_->WakeLocked(request->admission->attention);
    }
    request->write_blocked_since.reset();  // cancelled once
    request->stream->TryCancel();          // unblocks the Write
  }
}

void CoordinatorEngine::StartDrain() {
  absl::MutexLock lock(&core_->mu);
  core_->draining = true;
  for (uint64_t ticket : core_->scheduler.CancelAllQueued()) {
    auto it = by_ticket_.find(ticket);
    if (it == by_ticket_.end()) continue;
    it->second->phase = RequestPhase::kEnded;
    SetFinalLocked(*it->second, absl::Status(absl::StatusCode::kUnavailable,
                                             "draining: the coordinator is shutting down"));
  }
  UpdateGaugesLocked();
}

void CoordinatorEngine::SetFinalLocked(InFlightRequest& request, const absl::Status& status) {
  if (request.final_status.has_value()) return;
  request.final_status = status;
  // One line per request (docs/reliability.md, "Traceability"): its ids, outcome, sizes and
  // durations, and where it last ran.
  nlohmann::json fields = {
      {"request_id", request.id},
      {"caller", request.caller},
      {"trace_id", request.trace.trace_id},
      {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.code()))},
      {"context_tokens", ContextLength(request.proto)},
      {"generated_tokens", request.generated},
      {"migrations", request.migrations},
      {"duration_s", Seconds(core_->clock.Now() - request.arrival)}};
  if (!status.ok()) fields["message"] = std::string(status.message());
  if (request.generated > 0) {
    fields["ttft_s"] = Seconds(request.first_token_time - request.arrival);
  }
  if (request.admission.has_value()) {
    fields["indexer_worker"] = pool_->indexer(request.admission->indexer).address;
    fields["attention_worker"] = pool_->attention(request.admission->attention).address;
  }
  LogJson(status.ok() || status.code() == absl::StatusCode::kCancelled ? "info" : "warn", "request",
          std::move(fields));
  RequestOutcome outcome = RequestOutcome::kFailed;
  if (status.ok()) {
    outcome = RequestOutcome::kCompleted;
  } else if (status.code() == absl::StatusCode::kCancelled) {
    outcome = RequestOutcome::kCancelled;
  }
  core_->metrics->CountRequest(outcome);
  request.changed.SignalAll();
}

void CoordinatorEngine::UpdateGaugesLocked() {
  const SchedulerLoad load = core_->scheduler.Load();
  core_->metrics->SetQueued(load.queued);
  core_->metrics->SetRunning(load.running);
}

void CoordinatorEngine::AbortLocked(InFlightRequest& request) {
  if (request.final_status.has_value() || request.cancel_requested) return;
  request.cancel_requested = true;
  if (request.phase == RequestPhase::kQueued) {
    core_->scheduler.CancelQueued(request.ticket);
    request.phase = RequestPhase::kEnded;
    SetFinalLocked(request, absl::Status(absl::StatusCode::kCancelled, "aborted while queued"));
    // The head may have left: the next ones may fit now.
    if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
    UpdateGaugesLocked();
  } else if (request.phase == RequestPhase::kDecoding && request.admission.has_value()) {
    decode_->WakeLocked(request.admission->attention);
  }
  request.changed.SignalAll();
}

void CoordinatorEngine::DeliverAdmissionsLocked(std::vector<Admission> admissions) {
  for (Admission& admission : admissions) {
    auto it = by_ticket_.find(admission.ticket);
    if (it == by_ticket_.end()) continue;  // cannot happen: tickets leave the queue first
    InFlightRequest& request = *it->second;
    request.admission = std::move(admission);
    request.phase = RequestPhase::kPrefilling;
    request.changed.SignalAll();
  }
  UpdateGaugesLocked();
}

absl::Status CoordinatorEngine::ReleaseOnWorker(bool attention, int slot, uint64_t sequence_id,
                                                bool keep_indexer_sequence, absl::Duration timeout,
                                                const TraceContext* trace) {
  // The last checks of the worker did not reach it: a call would only wait for its deadline.
  if (pool_->KnownUnreachable(attention ? pool_->attention(slot).unreached_checks
                                        : pool_->indexer(slot).unreached_checks)) {
    return absl::UnavailableError(absl::StrCat(
        "not sent: the last checks of ", attention ? "attention" : "indexer", " worker ",
        attention ? pool_->attention(slot).address : pool_->indexer(slot).address,
        " did not reach it"));
  }
  const WorkerCall call{timeout, trace != nullptr ? trace->Child().ToTraceparent() : "", {}};
  if (attention) {
    av1::ReleaseRequest release;
    release.set_sequence_id(sequence_id);
    release.set_keep_indexer_sequence(keep_indexer_sequence);
    return pool_->attention(slot).client->Release(call, release);
  }
  iv1::ReleaseRequest release;
  release.set_sequence_id(sequence_id);
  return pool_->indexer(slot).client->Release(call, release);
}

std::vector<CoordinatorEngine::Unreleased> CoordinatorEngine::ReleaseSequence(
    int attention, int indexer, uint64_t sequence_id, bool keep_indexer_sequence, bool indexer_too,
    absl::Duration timeout, const TraceContext* trace) {
  std::vector<Unreleased> unreached;
  absl::Status attention_status;
  if (attention >= 0) {
    attention_status = ReleaseOnWorker(/*attention=*/true, attention, sequence_id,
                                       keep_indexer_sequence, timeout, trace);
    if (WorkerUnreached(attention_status)) {
      unreached.push_back({true, attention, sequence_id, keep_indexer_sequence});
    }
  }
  if (!keep_indexer_sequence && (indexer_too || !attention_status.ok())) {
    const absl::Status indexer_status = ReleaseOnWorker(
        /*attention=*/false, indexer, sequence_id, /*keep_indexer_sequence=*/false, timeout, trace);
    if (WorkerUnreached(indexer_status)) unreached.push_back({false, indexer, sequence_id, false});
  }
  return unreached;
}

void CoordinatorEngine::CarryOutEvictions(const std::vector<Eviction>& evictions) {
  // The scheduler has forgotten these sequences already. A worker that lost the sequence freed
  // it, but one that could not be reached may still hold it: its Release is retried when that
  // address answers again (ReleaseUnreleased, which sends it on to a restarted worker's new
  // process).
  std::vector<Unreleased> unreached;
  for (const Eviction& eviction : evictions) {
    const bool on_attention = eviction.release_on_attention || eviction.release_on_both;
    std::vector<Unreleased> more = ReleaseSequence(
        on_attention ? eviction.attention : -1, eviction.indexer, eviction.sequence_id,
        /*keep_indexer_sequence=*/false,
        /*indexer_too=*/eviction.release_on_both || !on_attention, core_->RpcTimeout(),
        /*trace=*/nullptr);
    for (Unreleased& u : more) u.counted = false;
    unreached.insert(unreached.end(), more.begin(), more.end());
  }
  if (unreached.empty()) return;
  absl::MutexLock lock(&core_->mu);
  unreleased_.insert(unreleased_.end(), unreached.begin(), unreached.end());
}

absl::Status CoordinatorEngine::Prefill(GenerateStream& stream, const InFlightRequest& request,
                                        const Admission& admission, av1::PrefillResponse* response,
                                        bool* cancelled) {
  const cv1::GenerateRequest& g = request.proto;
  const cv1::Overrides& o = g.overrides();
  av1::PrefillRequest prefill;
  prefill.set_sequence_id(admission.sequence_id);
  prefill.set_context_length(request.demand.context_length);
  for (uint64_t id : request.demand.prefix_block_ids) prefill.add_prefix_block_ids(id);
  if (request.real) {
    // The tokens of the new slots: all of them (the context, and after a migration the tokens
    // generated so far), or a session's from the sequence's length on (its last turn's last
    // token, which its KV does not hold yet, then the new turn's).
    const int64_t from = admission.continue_sequence ? admission.continued_length - 1 : 0;
    if (from < 0 || from >= static_cast<int64_t>(request.tokens.size())) {
      return absl::InternalError(absl::StrCat("a session's sequence of ", from + 1,
                                              " tokens cannot continue with ",
                                              request.tokens.size()));
    }
    prefill.mutable_tokens()->Add(request.tokens.begin() + from, request.tokens.end());
    av1::SamplingParams* sampling = prefill.mutable_sampling();
    sampling->set_temperature(g.sampling().temperature());
    sampling->set_top_p(g.sampling().top_p());
    sampling->set_seed(g.sampling().seed());
  }
  prefill.set_indexer_worker(pool_->indexer(admission.indexer).address);
  av1::SequenceSettings* settings = prefill.mutable_settings();
  settings->set_top_k(o.has_top_k() ? o.top_k() : core_->options.top_k);
  iv1::SpinSettings* spin = settings->mutable_spin();
  if (o.has_all_keep() ? o.all_keep() : core_->options.all_keep) {
    spin->set_all_keep(true);
  } else {
    spin->set_target_block_sparsity(o.has_target_block_sparsity()
                                        ? o.target_block_sparsity()
                                        : core_->options.target_block_sparsity);
  }
  spin->set_exploration_fraction(o.has_exploration_fraction()
                                     ? o.exploration_fraction()
                                     : core_->options.exploration_fraction);
  spin->set_seed(core_->options.seed);
  if (o.has_miss_target()) spin->set_miss_target(o.miss_target());
  if (admission.prefix_source_id.has_value()) {
    prefill.set_prefix_source_id(*admission.prefix_source_id);
    prefill.set_prefix_slots(admission.prefix_slots);
  }
  prefill.set_continue_sequence(admission.continue_sequence);
  // No deadline of its own (a long context takes long); cancelled with the Generate call (client
  // gone, its deadline, server shutdown) or by Abort, and cut short when the worker's checks stop
  // reaching it (a hung worker would hold it open for good).
  const WorkerPool::AttentionWorker& w = pool_->attention(admission.attention);
  std::atomic<bool> by_client{false};
  HungCut hung(w.unreached_checks, core_->options.hung_worker_checks);
  const WorkerCall call{absl::InfiniteDuration(), request.trace.Child().ToTraceparent(),
                        [this, &stream, &request, &by_client, &hung] {
                          bool aborted = false;
                          {
                            absl::MutexLock lock(&core_->mu);
                            aborted = request.cancel_requested;
                          }
                          if (aborted || stream.IsCancelled()) by_client = true;
                          return by_client.load() || hung.Poll();
                        }};
  const absl::Status status = w.client->Prefill(call, prefill, response);
  *cancelled = by_client.load() || stream.IsCancelled();
  return *cancelled ? status
                    : pool_->CallStatus(w, status, "prefill", hung.cut(), /*hung=*/nullptr);
}

absl::Status CoordinatorEngine::Generate(const cv1::GenerateRequest& generate,
                                         const std::string& caller, absl::string_view traceparent,
                                         GenerateStream& stream) {
  const cv1::GenerateRequest* proto = &generate;
  const absl::Time arrival = core_->clock.Now();
  if (absl::Status valid = ValidateGenerateRequest(*proto); !valid.ok()) {
    core_->metrics->CountRequest(RequestOutcome::kRejected);
    return valid;
  }
  auto request = std::make_shared<InFlightRequest>();
  request->id = proto->request_id();
  request->caller = caller;
  {
    std::optional<TraceContext> trace;
    if (!traceparent.empty()) trace = ParseTraceparent(traceparent);
    request->trace = trace.has_value() ? *trace : NewTraceContext();
  }
  request->proto = *proto;
  if (proto->sampling().temperature() > 0.0f && !proto->sampling().has_seed()) {
    // Without a seed two equal requests must still draw differently; the seed is fixed here,
    // once, so that a migration's re-prefill continues the same draws.
    request->proto.mutable_sampling()->set_seed(RequestSeed(
        core_->options.seed ^ sampling_seeds_drawn_.fetch_add(1, std::memory_order_relaxed),
        proto->request_id()));
  }
  request->arrival = arrival;
  request->demand.context_length = ContextLength(*proto);
  request->demand.max_new_tokens = proto->max_new_tokens();
  request->demand.draft_length = proto->draft_length();
  if (proto->has_context_tokens()) {
    // Ids of the tokens themselves (equal prefixes share, different ones never do).
    request->demand.prefix_block_ids = PrefixBlockIdsOfTokens(proto->context_tokens().tokens());
  } else {
    request->demand.prefix_block_ids.assign(proto->prefix_block_ids().begin(),
                                            proto->prefix_block_ids().end());
  }
  request->demand.session_id = proto->session_id();
  request->demand.session_owner = caller;
  const double acceptance_rate = proto->overrides().has_acceptance_rate()
                                     ? proto->overrides().acceptance_rate()
                                     : core_->options.acceptance_rate;
  request->acceptance =
      *AcceptanceModel::Create(acceptance_rate, proto->draft_length(),
                               RequestSeed(core_->options.seed, proto->request_id()));

  // The checks that need the model, outside the lock (a long context's ids take a while); the
  // model is looked at again under it.
  std::optional<ServedModel> model = pool_->model();
  if (model.has_value()) {
    if (absl::Status valid = ValidateGenerateRequestForModel(*proto, *model); !valid.ok()) {
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return valid;
    }
    request->real = model->real();
  }
  if (request->real) {
    request->vocab_size = model->vocab_size;
    request->eos_token_id = proto->ignore_eos() ? -1 : model->eos_token_id;
    request->stop_token_ids.assign(proto->stop_token_ids().begin(), proto->stop_token_ids().end());
    request->tokens.assign(proto->context_tokens().tokens().begin(),
                           proto->context_tokens().tokens().end());
  }

  {
    absl::MutexLock lock(&core_->mu);
    if (core_->draining || core_->stopping) {
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return absl::UnavailableError("draining: the coordinator admits no new requests");
    }
    if (!pool_->ReadyLocked()) {
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return {absl::StatusCode::kUnavailable,
              absl::StrCat("not ready: ", core_->scheduler.ReadyIndexers(), " of ",
                           pool_->NumIndexersLocked(), " indexer and ",
                           core_->scheduler.ReadyAttentions(), " of ", pool_->NumAttentionLocked(),
                           " attention workers are ready (a worker of each kind is needed)")};
    }
    if (!model.has_value() || pool_->ModelLocked() != model) {
      // Ready means an attention worker was taken in, so the model is known; it changed only if
      // every worker was replaced meanwhile.
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return absl::UnavailableError(
          "the attention workers' model changed while the request was checked; retry");
    }
    if (by_id_.contains({caller, request->id})) {
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return {absl::StatusCode::kAlreadyExists,
              absl::StrCat("request '", request->id, "' is already in flight")};
    }
    request->ticket = next_ticket_++;
    absl::StatusOr<std::optional<Admission>> submitted = core_->scheduler.Submit(
        request->ticket, request->demand, /*migrated=*/false, request->tokens);
    if (!submitted.ok()) {
      core_->metrics->CountRequest(RequestOutcome::kRejected);
      return submitted.status();
    }
    by_id_[{caller, request->id}] = request;
    by_ticket_[request->ticket] = request;
    request->stream = &stream;
    if (submitted->has_value()) {
      request->admission = **std::move(submitted);
      request->phase = RequestPhase::kPrefilling;
    }
    UpdateGaugesLocked();
  }

  // Removes the request from the in-flight maps when the handler returns.
  struct Unregister {
    CoordinatorEngine* self;
    const std::shared_ptr<InFlightRequest>& request;
    ~Unregister() {
      absl::MutexLock lock(&self->core_->mu);
      request->stream = nullptr;
      self->by_id_.erase({request->caller, request->id});
      self->by_ticket_.erase(request->ticket);
    }
  } unregister{this, request};

  // Writes one event; while it is blocked (the client's HTTP/2 window is full: it stopped reading)
  // WatchStalledWrites may cancel the call after the stall timeout, which unblocks it.
  auto write = [&](const cv1::GenerateEvent& event) {
    {
      absl::MutexLock lock(&core_->mu);
      request->write_blocked_since = core_->clock.Now();
    }
    const bool written = stream.Write(event);
    absl::MutexLock lock(&core_->mu);
    request->write_blocked_since.reset();
    return written;
  };

  // Placed, prefilled and decoded once, and again after each migration (FailSequence).
  bool admitted_sent = false;
  while (true) {
    // Wait for admission (or the end while queued).
    Admission admission;
    {
      absl::MutexLock lock(&core_->mu);
      while (!request->admission.has_value() && !request->final_status.has_value()) {
        request->changed.WaitWithTimeout(&core_->mu, kCancelPoll);
        if (stream.IsCancelled()) AbortLocked(*request);
      }
      if (request->final_status.has_value()) return *request->final_status;
      admission = *request->admission;
    }
    const absl::Time admitted_at = core_->clock.Now();
    if (!admitted_sent) core_->metrics->ObserveQueueDuration(Seconds(admitted_at - arrival));

    CarryOutEvictions(admission.evictions);
    av1::PrefillResponse prefilled;
    bool prefill_cancelled = false;
    absl::Status prefill_status =
        Prefill(stream, *request, admission, &prefilled, &prefill_cancelled);
    // A real model's first token (or, after a migration, its next one) comes from the prefill:
    // its Tokens event is queued before the sequence joins its decode loop.
    bool ended = false;  // that token ended the request
    if (prefill_status.ok() && request->real) {
      absl::StatusOr<DecodeLoops::Produced> first = decode_->FirstToken(*request, prefilled);
      if (first.ok()) {
        ended = decode_->AdvanceSequence(request, *first, /*result=*/nullptr, /*response=*/nullptr);
      } else {
        prefill_status = first.status();
      }
    }
    std::vector<Eviction> unpinned;
    bool decoding = false;
    {
      absl::MutexLock lock(&core_->mu);
      if (prefill_status.ok() && !ended && !request->cancel_requested && !stream.IsCancelled()) {
        unpinned = core_->scheduler.PrefillDone(admission.sequence_id);
        request->phase = RequestPhase::kDecoding;
        decoding = true;
        decode_->StartDecodingLocked(admission.attention, request);
      }
    }
    if (admission.prefix_source_id.has_value()) {
      // The donor is unpinned (evictable, or released now): queued requests may fit.
      CarryOutEvictions(unpinned);
      absl::MutexLock lock(&core_->mu);
      if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
    }
    if (ended) {
      // Done at its first token (max_new_tokens 1, an end-of-sequence or stop token): Finished is
      // queued; the sequence leaves its workers as after a last decode step (its donor, if any,
      // is unpinned by the scheduler's Finish).
      EndSequence(request, absl::OkStatus(), /*completed=*/true);
    } else if (!decoding) {
      // Failed or cancelled during the prefill: a failed prefill leaves nothing on the workers
      // (a worker's failure migrates it), a cancelled successful one is released by EndSequence.
      if (!prefill_status.ok() && !prefill_cancelled) {
        FailSequence(request, prefill_status);
      } else {
        EndSequence(request, absl::CancelledError("aborted during prefill"), /*completed=*/false);
      }
    }

    if ((decoding || ended) && !admitted_sent) {
      cv1::GenerateEvent admitted_event;
      cv1::Admitted* admitted = admitted_event.mutable_admitted();
      admitted->set_queue_seconds(Seconds(admitted_at - arrival));
      admitted->set_indexer_worker(pool_->indexer(admission.indexer).address);
      admitted->set_attention_worker(pool_->attention(admission.attention).address);
      admitted->set_prefix_slots_reused(
          admission.prefix_source_id.has_value() ? admission.prefix_slots : 0);
      admitted->set_prefill_seconds(prefilled.seconds());
      admitted_sent = true;
      if (!write(admitted_event)) {
        absl::MutexLock lock(&core_->mu);
        AbortLocked(*request);
      }
    }

    // Write the events until the end, or until the request must migrate.
    bool migrate = false;
    while (true) {
      cv1::GenerateEvent event;
      {
        absl::MutexLock lock(&core_->mu);
        while (request->events.empty() && !request->final_status.has_value() &&
               request->phase != RequestPhase::kMigrating) {
          request->changed.WaitWithTimeout(&core_->mu, kCancelPoll);
          if (stream.IsCancelled()) AbortLocked(*request);
        }
        if (request->events.empty()) {
          if (request->final_status.has_value()) return *request->final_status;
          migrate = true;
          break;
        }
        event = std::move(request->events.front());
        request->events.pop_front();
        decode_->WakeLocked(admission.attention);  // room in the queue
      }
      if (!write(event)) {
        absl::MutexLock lock(&core_->mu);
        AbortLocked(*request);
      }
    }
    if (migrate) {
      if (absl::Status placed = PlaceAgain(request); !placed.ok()) {
        absl::MutexLock lock(&core_->mu);
        SetFinalLocked(*request, placed);
        return *request->final_status;
      }
    }
  }
}

absl::Status CoordinatorEngine::Abort(const std::string& request_id, const std::string& caller) {
  absl::MutexLock lock(&core_->mu);
  // Keyed by caller too: another caller's request of this id is not found, so request ids in
  // flight cannot be probed.
  auto it = by_id_.find({caller, request_id});
  if (it == by_id_.end() || it->second->final_status.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("no request '", request_id, "' of this caller in flight"));
  }
  AbortLocked(*it->second);
  return absl::OkStatus();
}

cv1::GetLoadResponse CoordinatorEngine::GetLoad() {
  cv1::GetLoadResponse answer;
  cv1::GetLoadResponse* response = &answer;
  SchedulerLoad load;
  std::vector<bool> indexer_ready;
  std::vector<bool> indexer_retired;
  {
    absl::MutexLock lock(&core_->mu);
    load = core_->scheduler.Load();
    if (const std::optional<ServedModel> served = pool_->ModelLocked(); served.has_value()) {
      cv1::Model* model = response->mutable_model();
      model->set_name(served->name);
      model->set_vocab_size(served->vocab_size);
      model->set_eos_token_id(served->eos_token_id);
      model->set_max_context(served->max_context);
    }
    for (int i = 0; i < pool_->NumIndexersLocked(); ++i) {
      indexer_ready.push_back(pool_->indexer(i).ready);
      indexer_retired.push_back(pool_->indexer(i).retired);
    }
    for (int j = 0; j < pool_->NumAttentionLocked(); ++j) {
      if (pool_->attention(j).retired) continue;  // restarted: its new instance has its own entry
      cv1::AttentionWorkerLoad* worker = response->add_attention_workers();
      worker->set_address(pool_->attention(j).address);
      worker->set_ready(pool_->attention(j).ready);
      worker->set_decoding(decode_->DecodingLocked(j));
    }
  }
  response->set_queued(load.queued);
  response->set_running(load.running);
  response->set_retained_sequences(load.retained);
  // Ask the ready indexers at once (a worker that is not ready reports the reservations), unless
  // the last answers are recent enough and were asked of the same ready slots.
  const size_t count = indexer_ready.size();
  const WorkerPool::IndexerLoads answers = pool_->AskIndexerLoads(indexer_ready);
  const std::vector<iv1::GetLoadResponse>& loads = answers.loads;
  const std::vector<absl::Status>& statuses = answers.statuses;
  int64_t used = 0;
  int64_t capacity = 0;
  for (size_t i = 0; i < count; ++i) {
    if (indexer_retired[i]) continue;
    cv1::WorkerLoad* worker = response->add_indexer_workers();
    worker->set_address(pool_->indexer(i).address);
    worker->set_ready(indexer_ready[i]);
    const iv1::GetLoadResponse& indexer_load = loads[i];
    if (statuses[i].ok()) {
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
  return answer;
}

void CoordinatorEngine::LeaveWorkers(const std::shared_ptr<InFlightRequest>& request,
                                     bool completed, bool worker_failed) {
  Scheduler::FinishResult finish;
  uint64_t sequence_id = 0;
  int attention = 0;
  int indexer = 0;
  {
    absl::MutexLock lock(&core_->mu);
    const Admission& admission = *request->admission;
    sequence_id = admission.sequence_id;
    attention = admission.attention;
    indexer = admission.indexer;
    decode_->RemoveLocked(attention, request);
    // The sequence holds the context it was prefilled with and the tokens generated since.
    const int64_t length =
        request->demand.context_length + request->generated - request->generated_when_placed;
    // A real model's session keeps its tokens for its next turn's check.
    std::vector<int32_t> history;
    if (completed && request->real && !request->demand.session_id.empty()) {
      history = request->tokens;
    }
    finish = core_->scheduler.Finish(sequence_id, completed, length, std::move(history));
    UpdateGaugesLocked();
  }
  std::vector<Eviction> evictions = std::move(finish.evictions);
  if (finish.release_attention) {
    // After a failure the worker may be gone: a short deadline, and what it could not take is
    // retried when it answers again (ReleaseUnreleased).
    const absl::Duration timeout = worker_failed
                                       ? absl::Milliseconds(core_->options.worker_check_timeout_ms)
                                       : core_->RpcTimeout();
    // NOT_FOUND after a failed prefill (it leaves nothing behind) is expected. After a failure
    // the attention worker may have died: its indexer sequence is released directly too.
    std::vector<Unreleased> unreached =
        ReleaseSequence(attention, indexer, sequence_id, finish.keep_indexer_sequence,
                        /*indexer_too=*/worker_failed, timeout, &request->trace);
    absl::MutexLock lock(&core_->mu);
    const int undelivered = static_cast<int>(unreached.size());
    unreleased_.insert(unreleased_.end(), unreached.begin(), unreached.end());
    if (undelivered > 0) {
      undelivered_[sequence_id] = undelivered;  // ReleaseDone once delivered (ReleaseUnreleased)
    } else {
      std::vector<Eviction> more = core_->scheduler.ReleaseDone(sequence_id);
      evictions.insert(evictions.end(), more.begin(), more.end());
    }
  }
  CarryOutEvictions(evictions);
}

void CoordinatorEngine::EndSequence(const std::shared_ptr<InFlightRequest>& request,
                                    const absl::Status& status, bool completed,
                                    bool worker_failed) {
  LeaveWorkers(request, completed, worker_failed);
  absl::MutexLock lock(&core_->mu);
  request->phase = RequestPhase::kEnded;
  absl::Status final_status = status;
  if (request->cancel_requested && !completed) {
    final_status = absl::CancelledError(request->cancel_reason);
  }
  // The stream ends only now, so that a client that saw it end finds the space accounted free
  // (or the sequence retained) in GetLoad and in its next request's placement.
  SetFinalLocked(*request, final_status);
  if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  UpdateGaugesLocked();
}

void CoordinatorEngine::FailSequence(const std::shared_ptr<InFlightRequest>& request,
                                     const absl::Status& status) {
  absl::Status final_status = status;
  bool worker_failed = false;
  {
    absl::MutexLock lock(&core_->mu);
    const Admission& admission = *request->admission;
    // Only a prefill fails a request not yet decoding; a session's next turn continues a sequence.
    const bool creating =
        request->phase == RequestPhase::kPrefilling && !admission.continue_sequence;
    worker_failed = WorkerFailure(status, creating);
    const bool can_migrate = worker_failed && !request->cancel_requested && !core_->stopping;
    if (can_migrate && request->migrations >= core_->options.max_migrations) {
      final_status = absl::Status(status.code(),
                                  absl::StrCat(status.message(), " (after ", request->migrations,
                                               " migrations, --max-migrations)"));
    } else if (can_migrate) {
      final_status = absl::OkStatus();
    } else if (creating && status.code() == absl::StatusCode::kFailedPrecondition) {
      // The workers' refusal of the request (WorkerFailure): which ones refused, and why.
      final_status = absl::FailedPreconditionError(
          absl::StrCat("attention worker ", pool_->attention(admission.attention).address,
                       " with indexer worker ", pool_->indexer(admission.indexer).address,
                       " refused the request's sequence: ", status.message()));
    }
  }
  if (!final_status.ok()) {
    EndSequence(request, final_status, /*completed=*/false, worker_failed);
    return;
  }
  LeaveWorkers(request, /*completed=*/false, /*worker_failed=*/true);
  absl::MutexLock lock(&core_->mu);
  request->phase = RequestPhase::kMigrating;
  request->migrate_reason = status;
  request->changed.SignalAll();
  if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  UpdateGaugesLocked();
}

absl::Status CoordinatorEngine::PlaceAgain(const std::shared_ptr<InFlightRequest>& request) {
  // The worker that failed is checked first, so that the request does not go back to it, unless
  // one of its workers is known unreachable already (not ready after checks that did not reach
  // it: what cut its step short), when a check would only wait out its timeout again.
  bool known_unreachable = false;
  {
    absl::MutexLock lock(&core_->mu);
    const Admission& old = *request->admission;
    const WorkerPool::AttentionWorker& a = pool_->attention(old.attention);
    const WorkerPool::IndexerWorker& i = pool_->indexer(old.indexer);
    known_unreachable =
        pool_->KnownUnreachable(a.unreached_checks) || pool_->KnownUnreachable(i.unreached_checks);
  }
  if (!known_unreachable) pool_->RefreshWorkers();
  absl::MutexLock lock(&core_->mu);
  if (request->cancel_requested) {
    request->phase = RequestPhase::kEnded;
    return {absl::StatusCode::kCancelled, request->cancel_reason};
  }
  const Admission& old = *request->admission;
  LogJson("warn", "migrating a request off a failed worker",
          {{"request_id", request->id},
           {"attention_worker", pool_->attention(old.attention).address},
           {"indexer_worker", pool_->indexer(old.indexer).address},
           {"migration", request->migrations + 1},
           {"generated_tokens", request->generated},
           {"status", std::string(request->migrate_reason.message())}});
  by_ticket_.erase(request->ticket);
  request->ticket = next_ticket_++;
  by_ticket_[request->ticket] = request;
  request->admission.reset();
  request->demand.context_length = ContextLength(request->proto) + request->generated;
  request->demand.max_new_tokens = request->proto.max_new_tokens() - request->generated;
  request->generated_when_placed = request->generated;
  absl::StatusOr<std::optional<Admission>> submitted =
      core_->scheduler.Submit(request->ticket, request->demand, /*migrated=*/true);
  if (!submitted.ok()) {
    request->phase = RequestPhase::kEnded;
    return {static_cast<absl::StatusCode>(submitted.status().code()),
            absl::StrCat("migrating after ", request->migrate_reason.message(), ": ",
                         submitted.status().message())};
  }
  if (!submitted->has_value() && core_->draining) {
    // A drain admits nothing queued: end it now, retryable, rather than at the grace's end.
    core_->scheduler.CancelQueued(request->ticket);
    request->phase = RequestPhase::kEnded;
    return {absl::StatusCode::kUnavailable,
            absl::StrCat("draining: no worker could take the request at once after ",
                         request->migrate_reason.message())};
  }
  ++request->migrations;
  core_->metrics->CountMigration();
  if (submitted->has_value()) {
    request->admission = **std::move(submitted);
    request->phase = RequestPhase::kPrefilling;
  } else {
    request->phase = RequestPhase::kQueued;
  }
  UpdateGaugesLocked();
  return absl::OkStatus();
}

void CoordinatorEngine::ReleaseUnreleased() {
  std::vector<Unreleased> due;
  std::vector<Unreleased> done;  // delivered
  {
    absl::MutexLock lock(&core_->mu);
    std::vector<Unreleased> later;
    for (Unreleased u : unreleased_) {
      const bool retired =
          u.attention ? pool_->attention(u.slot).retired : pool_->indexer(u.slot).retired;
      if (retired) {
        // The worker restarted. Its new process holds nothing of the old one, but it may hold
        // this sequence: one placed there after the restart and before a check saw it. The
        // Release goes to the process at that address now (NOT_FOUND when it holds nothing),
        // once it is taken in and ready.
        const std::string& address =
            u.attention ? pool_->attention(u.slot).address : pool_->indexer(u.slot).address;
        // Its reservation is freed now, as the old process's was (counted, below).
        if (u.counted) done.push_back(u);
        u.counted = false;
        const std::optional<int> now =
            u.attention ? pool_->AttentionSlotLocked(address) : pool_->IndexerSlotLocked(address);
        if (!now.has_value()) {
          later.push_back(u);
          continue;
        }
        u.slot = *now;
      }
      const bool ready =
          u.attention ? pool_->attention(u.slot).ready : pool_->indexer(u.slot).ready;
      (ready ? due : later).push_back(u);
    }
    unreleased_ = std::move(later);
  }
  for (const Unreleased& u : due) {
    const absl::Status status = ReleaseOnWorker(
        u.attention, u.slot, u.sequence_id, u.keep_indexer_sequence,
        absl::Milliseconds(core_->options.worker_check_timeout_ms), /*trace=*/nullptr);
    if (WorkerUnreached(status)) {
      absl::MutexLock lock(&core_->mu);
      unreleased_.push_back(u);
    } else {
      done.push_back(u);
    }
  }
  if (done.empty()) return;
  std::vector<Eviction> evictions;
  {
    absl::MutexLock lock(&core_->mu);
    for (const Unreleased& u : done) {
      if (!u.counted) continue;
      auto it = undelivered_.find(u.sequence_id);
      if (it == undelivered_.end() || --it->second > 0) continue;
      undelivered_.erase(it);
      // Every Release of the sequence reached its worker: its space is free now.
      std::vector<Eviction> more = core_->scheduler.ReleaseDone(u.sequence_id);
      evictions.insert(evictions.end(), more.begin(), more.end());
    }
  }
  CarryOutEvictions(evictions);
  absl::MutexLock lock(&core_->mu);
  if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  UpdateGaugesLocked();
}

absl::StatusOr<int> CoordinatorEngine::StepWorker(const std::string& address) {
  return decode_->StepWorker(address);
}

bool CoordinatorEngine::AwaitDecoding(const std::string& address, int count,
                                      absl::Duration timeout) {
  return decode_->AwaitDecoding(address, count, timeout);
}

void CoordinatorEngine::RefreshWorkers() { pool_->RefreshWorkers(); }

int CoordinatorEngine::RefreshesWaiting() const { return pool_->RefreshesWaiting(); }

void CoordinatorEngine::SetReadinessListener(std::function<void(bool ready)> listener) {
  pool_->SetReadinessListener(std::move(listener));
}

int CoordinatorEngine::num_full_layers() const { return pool_->num_full_layers(); }

std::optional<ServedModel> CoordinatorEngine::model() const { return pool_->model(); }

}  // namespace dsa
