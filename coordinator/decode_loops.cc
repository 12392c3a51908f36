// The coordinator's decode loops (see decode_loops.h).
#include "coordinator/decode_loops.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/ngram_drafter.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

DecodeLoops::DecodeLoops(EngineCore* core, WorkerPool* pool)
    : core_(core), pool_(pool), slots_(WorkerPool::kMaxWorkersPerKind) {}

void DecodeLoops::SetHooks(Hooks hooks) { hooks_ = std::move(hooks); }

void DecodeLoops::AddWorkerLocked(int slot) {
  slots_[slot] = std::make_unique<Slot>();
  if (core_->options.run_loops) {
    slots_[slot]->loop = std::thread([this, slot] { DecodeLoop(slot); });
  }
}

void DecodeLoops::StartDecodingLocked(int worker, std::shared_ptr<InFlightRequest> request) {
  slots_[worker]->decoding.push_back(std::move(request));
  slots_[worker]->wake.Signal();
  decoding_changed_.SignalAll();
}

void DecodeLoops::RemoveLocked(int worker, const std::shared_ptr<InFlightRequest>& request) {
  auto& decoding = slots_[worker]->decoding;
  decoding.erase(std::remove(decoding.begin(), decoding.end(), request), decoding.end());
}

void DecodeLoops::WakeLocked(int worker) { slots_[worker]->wake.Signal(); }

int DecodeLoops::DecodingLocked(int worker) const {
  return static_cast<int>(slots_[worker]->decoding.size());
}

void DecodeLoops::WakeAllLocked(int num_attention) {
  for (int j = 0; j < num_attention; ++j) slots_[j]->wake.SignalAll();
}

void DecodeLoops::Join(int num_attention) {
  for (int j = 0; j < num_attention; ++j) {
    if (slots_[j]->loop.joinable()) slots_[j]->loop.join();
  }
}

DecodeLoops::StepOutcome DecodeLoops::RunStep(
    int worker, const std::vector<std::shared_ptr<InFlightRequest>>& batch,
    const std::vector<int>& rows) {
  StepOutcome outcome;
  av1::DecodeStepRequest step;
  for (size_t i = 0; i < batch.size(); ++i) {
    av1::SequenceStep* s = step.add_sequences();
    s->set_sequence_id(batch[i]->admission->sequence_id);
    s->set_rows(rows[i]);
    if (batch[i]->real) {  // the last token, then the drafts (PlanDrafts)
      s->add_tokens(batch[i]->tokens.back());
      s->mutable_tokens()->Add(batch[i]->drafts.begin(), batch[i]->drafts.begin() + (rows[i] - 1));
    }
  }
  const WorkerPool::AttentionWorker& w = pool_->attention(worker);
  // Cut short once the worker's checks stop reaching it (a hung process holds the call open).
  HungCut hung(w.unreached_checks, core_->options.hung_worker_checks);
  const WorkerCall call{core_->RpcTimeout(), "", [&hung] { return hung.Poll(); }};
  const absl::Time start = core_->clock.Now();
  const absl::Status stepped = w.client->DecodeStep(call, step, &outcome.response);
  outcome.seconds = Seconds(core_->clock.Now() - start);
  outcome.status = pool_->CallStatus(w, stepped, "step", hung.cut(), &outcome.hung);
  if (outcome.status.ok() && outcome.response.sequences_size() != static_cast<int>(batch.size())) {
    outcome.status = absl::InternalError(absl::StrCat(
        "attention worker ", pool_->attention(worker).address, " answered ",
        outcome.response.sequences_size(), " results for ", batch.size(), " sequences"));
  }
  return outcome;
}

void DecodeLoops::ApplyStep(int worker, const std::vector<std::shared_ptr<InFlightRequest>>& batch,
                            const std::vector<int>& rows, const StepOutcome& outcome) {
  // What each sequence produced (a real model's: checked, and cut at its end), then the Commits of
  // the speculative ones, all at once, then the events.
  const size_t n = batch.size();
  std::vector<Produced> produced(n);
  std::vector<absl::Status> statuses(n);
  std::vector<AttentionWorkerClient::TracedCommit> commits;
  std::vector<size_t> committing;  // batch index of each commit
  for (size_t i = 0; i < n; ++i) {
    InFlightRequest& request = *batch[i];
    const av1::SequenceStepResult& result = outcome.response.sequences(i);
    Produced& p = produced[i];
    p.drafted = rows[i] - 1;
    p.seconds = outcome.seconds;
    if (!request.real) {
      if (rows[i] > 1) {
        p.accepted =
            std::min(request.acceptance->Accepted(request.verification_steps++), rows[i] - 1);
      }
      p.first_position = result.first_position();
      p.count = p.accepted + 1;
      if (request.generated + p.count >= request.spec.max_new_tokens) {
        p.finish = FinishReason::kLength;
      }
    } else {
      // Row r's input is at position t + r (t: the last token's, which the KV does not hold yet);
      // sampled_tokens[r] is the model's token for t + r + 1.
      const int64_t t = static_cast<int64_t>(request.tokens.size()) - 1;
      const auto& sampled = result.sampled_tokens();
      std::string wrong;
      if (result.first_position() != t) {
        wrong = absl::StrCat("first_position ", result.first_position(), ", expected ", t);
      } else if (sampled.size() != rows[i]) {
        wrong = absl::StrCat(sampled.size(), " sampled tokens for ", rows[i], " rows");
      } else {
        for (int r = 0; r < rows[i] && wrong.empty(); ++r) {
          if (sampled[r] < 0 || sampled[r] >= request.vocab_size) {
            wrong = absl::StrCat("sampled token ", sampled[r], " outside the vocabulary [0, ",
                                 request.vocab_size, ")");
          }
        }
      }
      if (!wrong.empty()) {
        statuses[i] =
            absl::InternalError(absl::StrCat("attention worker ", pool_->attention(worker).address,
                                             " answered a step it cannot have taken: ", wrong));
        continue;  // no Commit: the sequence leaves the worker (`fail`), its step with it
      }
      // Accept while the draft equals the model's own token at its position: exact for greedy
      // and, for a deterministic draft, the rejection sampling of speculative decoding.
      int a = 0;
      while (a < rows[i] - 1 && request.drafts[a] == sampled[a]) ++a;
      std::vector<int32_t> candidates(request.drafts.begin(), request.drafts.begin() + a);
      candidates.push_back(sampled[a]);
      p = CutEmission(request, candidates);
      p.first_position = t + 1;
      p.drafted = rows[i] - 1;
      p.accepted = a;
      p.seconds = outcome.seconds;
    }
    if (rows[i] > 1) {
      AttentionWorkerClient::TracedCommit commit;
      commit.request.set_sequence_id(request.admission->sequence_id);
      // The KV keeps positions t..t + count - 1: every emitted token but the last.
      commit.request.set_accepted(p.count - 1);
      commit.traceparent = request.trace.Child().ToTraceparent();
      commits.push_back(std::move(commit));
      committing.push_back(i);
    }
  }
  const WorkerPool::AttentionWorker& w = pool_->attention(worker);
  HungCut hung(w.unreached_checks, core_->options.hung_worker_checks);
  if (!commits.empty()) {
    std::vector<absl::Status> committed =
        w.client->Commit(core_->RpcTimeout(), commits, [&hung] { return hung.Poll(); });
    for (size_t c = 0; c < committing.size(); ++c) {
      statuses[committing[c]] = c < committed.size()
                                    ? pool_->CallStatus(w, committed[c], "commit", hung.cut(),
                                                        /*hung=*/nullptr)
                                    : absl::InternalError("the worker client lost a Commit");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!statuses[i].ok()) {
      hooks_.fail(batch[i], statuses[i]);
      continue;
    }
    if (AdvanceSequence(batch[i], produced[i], &outcome.response.sequences(i), &outcome.response)) {
      hooks_.end(batch[i], absl::OkStatus(), /*completed=*/true);
    }
  }
}

DecodeLoops::Produced DecodeLoops::CutEmission(const InFlightRequest& request,
                                               const std::vector<int32_t>& candidates) const {
  Produced p;
  const int64_t left = request.spec.max_new_tokens - request.generated;
  for (int32_t token : candidates) {
    p.token_ids.push_back(token);
    if (token == request.eos_token_id) {  // -1 (none, or ignore_eos) never matches
      p.finish = FinishReason::kEos;
      p.stop_token = token;
    } else if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), token) !=
               request.stop_token_ids.end()) {
      p.finish = FinishReason::kStopToken;
      p.stop_token = token;
    } else if (static_cast<int64_t>(p.token_ids.size()) >= left) {
      p.finish = FinishReason::kLength;
    }
    if (p.finish != FinishReason::kUnspecified) break;
  }
  p.count = static_cast<int>(p.token_ids.size());
  return p;
}

absl::StatusOr<DecodeLoops::Produced> DecodeLoops::FirstToken(
    const InFlightRequest& request, const av1::PrefillResponse& prefilled) const {
  if (!prefilled.has_next_token() || prefilled.next_token() < 0 ||
      prefilled.next_token() >= request.vocab_size) {
    return absl::InternalError(
        absl::StrCat("attention worker ", pool_->attention(request.admission->attention).address,
                     " answered a real model's prefill with ",
                     prefilled.has_next_token()
                         ? absl::StrCat("next_token ", prefilled.next_token(),
                                        ", outside the vocabulary [0, ", request.vocab_size, ")")
                         : std::string("no next_token")));
  }
  Produced p = CutEmission(request, {prefilled.next_token()});
  p.first_position = static_cast<int64_t>(request.tokens.size());
  p.seconds = prefilled.seconds();
  return p;
}

void DecodeLoops::PlanDrafts(const std::vector<std::shared_ptr<InFlightRequest>>& batch,
                             std::vector<int>* rows) {
  for (size_t i = 0; i < batch.size(); ++i) {
    InFlightRequest& request = *batch[i];
    if (!request.real) continue;
    const int64_t left = request.spec.max_new_tokens - request.generated;
    const int max_draft =
        static_cast<int>(std::min<int64_t>(request.demand.draft_length, left - 1));
    request.drafts = ProposeNgramDraft(request.tokens, max_draft, core_->options.ngram);
    (*rows)[i] = 1 + static_cast<int>(request.drafts.size());
  }
}

bool DecodeLoops::AdvanceSequence(const std::shared_ptr<InFlightRequest>& request,
                                  const Produced& produced, const av1::SequenceStepResult* result,
                                  const av1::DecodeStepResponse* response) {
  if (produced.drafted > 0)
    core_->metrics->CountSpeculativeStep(produced.drafted, produced.accepted);
  const int count = produced.count;
  const absl::Time now = core_->clock.Now();
  if (request->generated == 0) {
    request->first_token_time = now;
    request->first_count = count;
    core_->metrics->ObserveTimeToFirstToken(Seconds(now - request->arrival));
  } else {
    core_->metrics->ObserveInterTokenLatency(Seconds(now - request->last_step_time) / count);
  }
  request->last_step_time = now;
  request->generated += count;
  if (request->real) {
    request->tokens.insert(request->tokens.end(), produced.token_ids.begin(),
                           produced.token_ids.end());
  }
  core_->metrics->CountGeneratedTokens(count);

  TokensEvent tokens;
  tokens.first_position = produced.first_position;
  tokens.count = count;
  tokens.drafted = produced.drafted;
  tokens.accepted = produced.accepted;
  tokens.step_seconds = produced.seconds;
  if (result != nullptr) {
    tokens.blocks_scored = result->blocks_scored();
    tokens.blocks_visible = result->blocks_visible();
    tokens.audited_rows = result->audited_rows();
    tokens.audit_miss_rate_sum = result->audit_miss_rate_sum();
  }
  if (response != nullptr) {
    tokens.selection_wait_seconds.assign(response->selection_wait_seconds().begin(),
                                         response->selection_wait_seconds().end());
  }
  tokens.token_ids = produced.token_ids;
  const bool done = produced.finish != FinishReason::kUnspecified;
  {
    absl::MutexLock lock(&core_->mu);
    request->events.emplace_back(std::move(tokens));
    if (done) {
      FinishedEvent finished;
      finished.generated_tokens = request->generated;
      finished.migrations = request->migrations;
      finished.time_to_first_token_seconds = Seconds(request->first_token_time - request->arrival);
      const int64_t later = request->generated - request->first_count;
      finished.mean_inter_token_latency_seconds =
          later > 0 ? Seconds(request->last_step_time - request->first_token_time) /
                          static_cast<double>(later)
                    : 0.0;
      finished.finish_reason = produced.finish;
      finished.stop_token_id = produced.stop_token;
      request->events.emplace_back(finished);
    }
    request->changed.SignalAll();
  }
  return done;
}

DecodeLoops::Iteration DecodeLoops::CollectLocked(int worker) {
  Slot& w = *slots_[worker];
  const size_t room = static_cast<size_t>(core_->options.max_pending_events) - 2;
  Iteration it;
  const absl::Time now = core_->clock.Now();
  for (const auto& request : w.decoding) {
    if (request->cancel_requested) {
      it.cancelled.push_back(request);
    } else if (request->events.size() <= room) {
      request->stalled_since.reset();
      it.batch.push_back(request);
      const int64_t left = request->spec.max_new_tokens - request->generated;
      it.rows.push_back(
          static_cast<int>(std::min<int64_t>(request->demand.draft_length + 1, left)));
    } else if (core_->options.stall_timeout_ms > 0) {
      // The reader has not taken its events: after the stall timeout, end the request.
      if (!request->stalled_since.has_value()) request->stalled_since = now;
      if (now - *request->stalled_since >= absl::Milliseconds(core_->options.stall_timeout_ms)) {
        request->cancel_reason = absl::StrCat(
            "the client left ", request->events.size(), " events unread for ",
            core_->options.stall_timeout_ms, " ms (--stall-timeout-ms); request ended");
        request->cancel_requested = true;
        if (request->stream != nullptr) request->stream->TryCancel();
        request->changed.SignalAll();
        it.cancelled.push_back(request);
      } else {
        it.stalled = true;
      }
    }
  }
  return it;
}

void DecodeLoops::RunIteration(int worker, const Iteration& it) {
  for (const auto& request : it.cancelled) {
    hooks_.end(request, absl::CancelledError(request->cancel_reason), false);
  }
  if (it.batch.empty()) return;
  const auto& batch = it.batch;
  std::vector<int> rows = it.rows;
  PlanDrafts(batch, &rows);
  StepOutcome outcome = RunStep(worker, batch, rows);
  if (outcome.status.ok()) {
    ApplyStep(worker, batch, rows, outcome);
    return;
  }
  // The batch failed; sequences the attention worker rolled back can go on: find the failing
  // ones by stepping each alone (a sequence it marked broken fails again, FAILED_PRECONDITION),
  // unless the worker hung (a deadline): then retrying one by one would only multiply the wait.
  // The failing ones go to the `fail` hook (they migrate).
  for (size_t i = 0; i < batch.size(); ++i) {
    StepOutcome alone =
        batch.size() == 1 || outcome.hung ? outcome : RunStep(worker, {batch[i]}, {rows[i]});
    if (alone.status.ok()) {
      ApplyStep(worker, {batch[i]}, {rows[i]}, alone);
    } else {
      hooks_.fail(batch[i], alone.status);
    }
  }
}

void DecodeLoops::DecodeLoop(int worker) {
  Slot& w = *slots_[worker];
  while (true) {
    Iteration it;
    {
      absl::MutexLock lock(&core_->mu);
      while (true) {
        if (core_->stopping) return;
        it = CollectLocked(worker);
        if (!it.batch.empty() || !it.cancelled.empty()) break;
        if (it.stalled) {
          w.wake.WaitWithTimeout(&core_->mu, absl::Milliseconds(100));  // to see the timeout pass
        } else {
          w.wake.Wait(&core_->mu);
        }
      }
    }
    RunIteration(worker, it);
  }
}

absl::StatusOr<int> DecodeLoops::StepWorker(const std::string& address) {
  if (core_->options.run_loops) {
    return absl::FailedPreconditionError("StepWorker drives an engine without run_loops only");
  }
  Iteration it;
  int worker = 0;
  {
    absl::MutexLock lock(&core_->mu);
    std::optional<int> found = pool_->AttentionSlotLocked(address);
    if (!found.has_value()) {
      return absl::NotFoundError(absl::StrCat("no attention worker ", address, " taken in"));
    }
    worker = *found;
    it = CollectLocked(worker);
  }
  RunIteration(worker, it);
  return static_cast<int>(it.batch.size() + it.cancelled.size());
}

bool DecodeLoops::AwaitDecoding(const std::string& address, int count, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  absl::MutexLock lock(&core_->mu);
  while (true) {
    std::optional<int> found = pool_->AttentionSlotLocked(address);
    if (found.has_value() && static_cast<int>(slots_[*found]->decoding.size()) >= count) {
      return true;
    }
    if (decoding_changed_.WaitWithDeadline(&core_->mu, until)) return false;
  }
}

}  // namespace dsa
