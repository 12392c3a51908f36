// The life of a Generate request in the coordinator (see request_lifecycle.h).
#include "coordinator/request_lifecycle.h"

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "contracts/limits.h"
#include "coordinator/acceptance_model.h"
#include "coordinator/request_validation.h"
#include "coordinator/token_blocks.h"
#include "dsa/indexer/v1/indexer.pb.h"
#include "nlohmann/json.hpp"
#include "server/server.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

// How often a waiting handler looks at its call's cancellation.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

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
// (RequestLifecycle::FailSequence), not a refusal of the request itself. `creating`: the
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

// Whether a Prefill's `status` says its attention worker could not reach the indexer at
// `indexer` (UNAVAILABLE or DEADLINE_EXCEEDED naming it), as opposed to the attention worker
// itself failing: the attention worker's indexer calls name their indexer.
bool IndexerUnreachedByPrefill(const absl::Status& status, const std::string& indexer) {
  return WorkerUnreached(status) &&
         absl::StrContains(status.message(), absl::StrCat("indexer worker ", indexer));
}

}  // namespace

RequestLifecycle::RequestLifecycle(EngineCore* core, WorkerPool* pool, DecodeLoops* decode)
    : core_(core), pool_(pool), decode_(decode), releases_(core, pool) {
  core_->metrics->SetMaxQueued(core_->options.max_queue);
}

void RequestLifecycle::AfterRefresh(const std::vector<Eviction>& evictions) {
  releases_.CarryOutEvictions(evictions);
  ReleaseUnreleased();
}

void RequestLifecycle::WorkersRefreshedLocked(bool any_became_ready) {
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

void RequestLifecycle::WatchStalledWrites() {
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

void RequestLifecycle::CheckStalledWrites() {
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

void RequestLifecycle::StartDrain() {
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

void RequestLifecycle::SetFinalLocked(InFlightRequest& request, const absl::Status& status) {
  if (request.final_status.has_value()) return;
  request.final_status = status;
  // One line per request (docs/reliability.md, "Traceability"): its ids, outcome, sizes and
  // durations, and where it last ran.
  nlohmann::json fields = {
      {"request_id", request.id},
      {"caller", request.caller},
      {"trace_id", request.trace.trace_id},
      {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.code()))},
      {"context_tokens", ContextLength(request.spec)},
      {"generated_tokens", request.generated},
      {"migrations", request.migrations},
      {"duration_s", Seconds(core_->clock.Now() - request.arrival)}};
  if (!status.ok()) fields["reason"] = std::string(status.message());
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
  core_->metrics->CountRequest(outcome, status.code());
  core_->metrics->ObserveRequestDuration(Seconds(core_->clock.Now() - request.arrival));
  request.changed.SignalAll();
}

absl::Status RequestLifecycle::Rejected(const GenerateSpec& spec, const std::string& caller,
                                        absl::string_view traceparent, absl::Status status) {
  std::optional<TraceContext> trace;
  if (!traceparent.empty()) trace = ParseTraceparent(traceparent);
  // An id over the limit (one of the refusals) is logged cut to it.
  const bool long_id = spec.request_id.size() > kMaxRequestIdBytes;
  nlohmann::json fields = {
      {"request_id",
       long_id ? spec.request_id.substr(0, kMaxRequestIdBytes) + "..." : spec.request_id},
      {"caller", caller},
      {"code", absl::StatusCodeToString(status.code())},
      {"reason", std::string(status.message())}};
  if (trace.has_value()) fields["trace_id"] = trace->trace_id;
  LogJson("warn", "request rejected", std::move(fields));
  core_->metrics->CountRequest(RequestOutcome::kRejected, status.code());
  return status;
}

void RequestLifecycle::UpdateGaugesLocked() {
  const SchedulerLoad load = core_->scheduler.Load();
  core_->metrics->SetQueued(load.queued);
  core_->metrics->SetRunning(load.running);
}

void RequestLifecycle::AbortLocked(InFlightRequest& request) {
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

void RequestLifecycle::DeliverAdmissionsLocked(std::vector<Admission> admissions) {
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

absl::Status RequestLifecycle::Prefill(GenerateStream& stream, const InFlightRequest& request,
                                       const Admission& admission, av1::PrefillResponse* response,
                                       bool* cancelled) {
  const GenerateSpec& g = request.spec;
  const GenerateOverrides& o = g.overrides;
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
    sampling->set_temperature(g.sampling.temperature);
    sampling->set_top_p(g.sampling.top_p);
    sampling->set_seed(g.sampling.seed.value_or(0));
  }
  prefill.set_indexer_worker(pool_->indexer(admission.indexer).address);
  // Held under this coordinator's lease, on the attention worker and its indexer, so that the
  // workers let go of it if this coordinator dies or is cut off past the ttl.
  if (core_->LeasesOn()) *prefill.mutable_lease() = core_->lease;
  av1::SequenceSettings* settings = prefill.mutable_settings();
  settings->set_top_k(o.top_k.has_value() ? *o.top_k : core_->options.top_k);
  iv1::SpinSettings* spin = settings->mutable_spin();
  if (o.all_keep.has_value() ? *o.all_keep : core_->options.all_keep) {
    spin->set_all_keep(true);
  } else {
    spin->set_target_block_sparsity(o.target_block_sparsity.has_value()
                                        ? *o.target_block_sparsity
                                        : core_->options.target_block_sparsity);
  }
  spin->set_exploration_fraction(o.exploration_fraction.has_value()
                                     ? *o.exploration_fraction
                                     : core_->options.exploration_fraction);
  spin->set_seed(core_->options.seed);
  if (o.miss_target.has_value()) spin->set_miss_target(*o.miss_target);
  if (admission.prefix_source_id.has_value()) {
    prefill.set_prefix_source_id(*admission.prefix_source_id);
    prefill.set_prefix_slots(admission.prefix_slots);
  }
  prefill.set_continue_sequence(admission.continue_sequence);
  {
    // The probe of an indexer taken in again after a restart (WorkerPool::BeginPrefillLocked).
    absl::MutexLock lock(&core_->mu);
    pool_->BeginPrefillLocked(admission.indexer);
  }
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

absl::Status RequestLifecycle::Generate(const GenerateSpec& generate, const std::string& caller,
                                        absl::string_view traceparent, GenerateStream& stream) {
  const GenerateSpec* spec = &generate;
  const absl::Time arrival = core_->clock.Now();
  if (absl::Status valid = ValidateGenerateRequest(*spec); !valid.ok()) {
    return Rejected(*spec, caller, traceparent, std::move(valid));
  }
  auto request = std::make_shared<InFlightRequest>();
  request->id = spec->request_id;
  request->caller = caller;
  {
    std::optional<TraceContext> trace;
    if (!traceparent.empty()) trace = ParseTraceparent(traceparent);
    request->trace = trace.has_value() ? *trace : NewTraceContext();
  }
  request->spec = *spec;
  if (spec->sampling.temperature > 0.0f && !spec->sampling.seed.has_value()) {
    // Without a seed two equal requests must still draw differently; the seed is fixed here,
    // once, so that a migration's re-prefill continues the same draws.
    request->spec.sampling.seed = RequestSeed(
        core_->options.seed ^ sampling_seeds_drawn_.fetch_add(1, std::memory_order_relaxed),
        spec->request_id);
  }
  request->arrival = arrival;
  request->demand.context_length = ContextLength(*spec);
  request->demand.max_new_tokens = spec->max_new_tokens;
  request->demand.draft_length = spec->draft_length;
  if (spec->context_tokens.has_value()) {
    // Ids of the tokens themselves (equal prefixes share, different ones never do).
    request->demand.prefix_block_ids = PrefixBlockIdsOfTokens(*spec->context_tokens);
  } else {
    request->demand.prefix_block_ids = spec->prefix_block_ids;
  }
  request->demand.session_id = spec->session_id;
  request->demand.caller = caller;
  const double acceptance_rate = spec->overrides.acceptance_rate.has_value()
                                     ? *spec->overrides.acceptance_rate
                                     : core_->options.acceptance_rate;
  request->acceptance = *AcceptanceModel::Create(
      acceptance_rate, spec->draft_length, RequestSeed(core_->options.seed, spec->request_id));

  // The checks that need the model, outside the lock (a long context's ids take a while); the
  // model is looked at again under it.
  std::optional<ServedModel> model = pool_->model();
  if (model.has_value()) {
    if (absl::Status valid = ValidateGenerateRequestForModel(*spec, *model); !valid.ok()) {
      return Rejected(*spec, caller, traceparent, std::move(valid));
    }
    request->real = model->real();
  }
  if (request->real) {
    request->vocab_size = model->vocab_size;
    request->eos_token_id = spec->ignore_eos ? -1 : model->eos_token_id;
    request->stop_token_ids = spec->stop_token_ids;
    request->tokens = *spec->context_tokens;
  }

  {
    // A refusal is worked out under the lock and logged after it (Rejected writes a log line: no
    // I/O under the lock every admission takes).
    absl::ReleasableMutexLock lock(&core_->mu);
    absl::Status refusal;
    if (core_->draining || core_->stopping) {
      refusal = absl::UnavailableError("draining: the coordinator admits no new requests");
    } else if (!pool_->ReadyLocked()) {
      refusal = {
          absl::StatusCode::kUnavailable,
          absl::StrCat("not ready: ", core_->scheduler.ReadyIndexers(), " of ",
                       pool_->NumIndexersLocked(), " indexer and ",
                       core_->scheduler.ReadyAttentions(), " of ", pool_->NumAttentionLocked(),
                       " attention workers are ready (a worker of each kind is needed)")};
    } else if (!model.has_value() || pool_->ModelLocked() != model) {
      // Ready means an attention worker was taken in, so the model is known; it changed only if
      // every worker was replaced meanwhile.
      refusal = absl::UnavailableError(
          "the attention workers' model changed while the request was checked; retry");
    } else if (by_id_.contains({caller, request->id})) {
      refusal = {absl::StatusCode::kAlreadyExists,
                 absl::StrCat("request '", request->id, "' is already in flight")};
    }
    if (!refusal.ok()) {
      lock.Release();
      return Rejected(*spec, caller, traceparent, std::move(refusal));
    }
    request->ticket = next_ticket_++;
    (void)pool_->ReleaseExpiredHoldsLocked();  // an indexer whose hold ran out takes it
    absl::StatusOr<std::optional<Admission>> submitted = core_->scheduler.Submit(
        request->ticket, request->demand, /*migrated=*/false, request->tokens);
    if (!submitted.ok()) {
      lock.Release();
      return Rejected(*spec, caller, traceparent, submitted.status());
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
    RequestLifecycle* self;
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
  auto write = [&](const GenerateEvent& event) {
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
  bool prompt_counted = false;
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
    if (!prompt_counted) {  // once, whatever placements follow (a failed one, a migration)
      core_->metrics->CountPromptTokens(ContextLength(request->spec));
      prompt_counted = true;
    }

    releases_.CarryOutEvictions(admission.evictions);
    av1::PrefillResponse prefilled;
    bool prefill_cancelled = false;
    absl::Status prefill_status =
        Prefill(stream, *request, admission, &prefilled, &prefill_cancelled);
    {
      // A Prefill that could not reach its indexer holds it (FailSequence); any other outcome
      // ends a probe, and a success ends the indexer's hold.
      absl::MutexLock lock(&core_->mu);
      const bool unreached =
          !prefill_status.ok() && !prefill_cancelled &&
          IndexerUnreachedByPrefill(prefill_status, pool_->indexer(admission.indexer).address);
      if (!unreached && pool_->EndPrefillLocked(admission.indexer, prefill_status.ok()) &&
          !core_->draining) {
        DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
      }
    }
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
      releases_.CarryOutEvictions(unpinned);
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
      AdmittedEvent admitted;
      admitted.queue_seconds = Seconds(admitted_at - arrival);
      admitted.indexer_worker = pool_->indexer(admission.indexer).address;
      admitted.attention_worker = pool_->attention(admission.attention).address;
      admitted.prefix_slots_reused =
          admission.prefix_source_id.has_value() ? admission.prefix_slots : 0;
      admitted.prefill_seconds = prefilled.seconds();
      admitted_sent = true;
      if (!write(GenerateEvent(std::move(admitted)))) {
        absl::MutexLock lock(&core_->mu);
        AbortLocked(*request);
      }
    }

    // Write the events until the end, or until the request must migrate.
    bool migrate = false;
    while (true) {
      GenerateEvent event;
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

absl::Status RequestLifecycle::Abort(const std::string& request_id, const std::string& caller) {
  {
    absl::MutexLock lock(&core_->mu);
    // Keyed by caller too: another caller's request of this id is not found, so request ids in
    // flight cannot be probed.
    auto it = by_id_.find({caller, request_id});
    if (it != by_id_.end() && !it->second->final_status.has_value()) {
      AbortLocked(*it->second);
      return absl::OkStatus();
    }
  }
  // Logged outside the lock; an id over the limit is cut (it is the caller's to choose).
  const std::string id = request_id.size() > kMaxRequestIdBytes
                             ? request_id.substr(0, kMaxRequestIdBytes) + "..."
                             : request_id;
  absl::Status status =
      absl::NotFoundError(absl::StrCat("no request '", id, "' of this caller in flight"));
  LogJson("info", "abort refused",
          {{"request_id", id},
           {"caller", caller},
           {"code", absl::StatusCodeToString(status.code())},
           {"reason", std::string(status.message())}});
  return status;
}

void RequestLifecycle::LeaveWorkers(const std::shared_ptr<InFlightRequest>& request, bool completed,
                                    bool worker_failed) {
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
    std::vector<Eviction> more =
        releases_.ReleaseFinished(attention, indexer, sequence_id, finish.keep_indexer_sequence,
                                  /*indexer_too=*/worker_failed, timeout, &request->trace);
    evictions.insert(evictions.end(), more.begin(), more.end());
  }
  releases_.CarryOutEvictions(evictions);
}

void RequestLifecycle::EndSequence(const std::shared_ptr<InFlightRequest>& request,
                                   const absl::Status& status, bool completed, bool worker_failed) {
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

void RequestLifecycle::FailSequence(const std::shared_ptr<InFlightRequest>& request,
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
    if (worker_failed) {  // the next check that times out takes them out at once
      WorkerPool::AttentionWorker& attention = pool_->attention(admission.attention);
      WorkerPool::IndexerWorker& indexer = pool_->indexer(admission.indexer);
      attention.call_failed = indexer.call_failed = true;
      ++attention.call_failures;
      ++indexer.call_failures;
    }
    const bool can_migrate = worker_failed && !request->cancel_requested && !core_->stopping;
    // A new sequence's Prefill that could not reach its indexer lost nothing: placing it again is
    // no migration (bounded by kMaxUnreachedPlacements), after the indexer's hold when no other
    // indexer can take it.
    bool unreached_indexer =
        creating && IndexerUnreachedByPrefill(status, pool_->indexer(admission.indexer).address);
    std::optional<WorkerPool::IndexerHold> hold;
    if (unreached_indexer) hold = pool_->HoldIndexerLocked(admission.indexer, status);
    unreached_indexer = unreached_indexer && can_migrate && core_->options.max_migrations > 0 &&
                        request->unreached_placements < kMaxUnreachedPlacements;
    if (unreached_indexer) {
      request->place_after = hold->placeable ? hold->until : core_->clock.Now();
      final_status = absl::OkStatus();
    } else if (can_migrate && request->migrations >= core_->options.max_migrations) {
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

absl::Status RequestLifecycle::PlaceAgain(const std::shared_ptr<InFlightRequest>& request) {
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
  // A Prefill that could not reach its indexer: wait out the indexer's hold (when it is the only
  // one that can take the request), then place again without counting a migration.
  const bool unreached_retry = request->place_after.has_value();
  if (unreached_retry) {
    if (core_->clock.Now() < *request->place_after) {
      ++placement_waits_;
      placement_waits_changed_.SignalAll();
    }
    while (core_->clock.Now() < *request->place_after && !request->cancel_requested &&
           !core_->stopping) {
      request->changed.WaitWithTimeout(&core_->mu, kCancelPoll);
      if (request->stream != nullptr && request->stream->IsCancelled()) AbortLocked(*request);
    }
    request->place_after.reset();
  }
  const bool released = pool_->ReleaseExpiredHoldsLocked();
  if (request->cancel_requested) {
    request->phase = RequestPhase::kEnded;
    return {absl::StatusCode::kCancelled, request->cancel_reason};
  }
  const Admission& old = *request->admission;
  if (unreached_retry) {
    LogJson("info", "placing a request again: its Prefill could not reach its indexer",
            {{"request_id", request->id},
             {"attention_worker", pool_->attention(old.attention).address},
             {"indexer_worker", pool_->indexer(old.indexer).address},
             {"placement", request->unreached_placements + 1},
             {"generated_tokens", request->generated},
             {"status", std::string(request->migrate_reason.message())}});
  } else {
    LogJson("warn", "migrating a request off a failed worker",
            {{"request_id", request->id},
             {"attention_worker", pool_->attention(old.attention).address},
             {"indexer_worker", pool_->indexer(old.indexer).address},
             {"migration", request->migrations + 1},
             {"generated_tokens", request->generated},
             {"status", std::string(request->migrate_reason.message())}});
  }
  by_ticket_.erase(request->ticket);
  request->ticket = next_ticket_++;
  by_ticket_[request->ticket] = request;
  request->admission.reset();
  request->demand.context_length = ContextLength(request->spec) + request->generated;
  request->demand.max_new_tokens = request->spec.max_new_tokens - request->generated;
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
  if (unreached_retry) {
    ++request->unreached_placements;
  } else {
    ++request->migrations;
    core_->metrics->CountMigration();
  }
  if (submitted->has_value()) {
    request->admission = **std::move(submitted);
    request->phase = RequestPhase::kPrefilling;
  } else {
    request->phase = RequestPhase::kQueued;
  }
  if (released && !core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  UpdateGaugesLocked();
  return absl::OkStatus();
}

bool RequestLifecycle::AwaitPlacementWaits(int count, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  absl::MutexLock lock(&core_->mu);
  while (placement_waits_ < count) {
    if (placement_waits_changed_.WaitWithDeadline(&core_->mu, until)) return false;
  }
  return true;
}

void RequestLifecycle::ReleaseUnreleased() {
  if (!releases_.RetryUnreleased()) return;
  absl::MutexLock lock(&core_->mu);
  if (!core_->draining) DeliverAdmissionsLocked(core_->scheduler.AdmitQueued());
  UpdateGaugesLocked();
}

}  // namespace dsa
