// In-memory workers for CoordinatorEngine (see fake_workers.h).
#include "tests/coordinator/fake_workers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/lease_codec.h"
#include "tests/coordinator/tiny_model.h"

namespace dsa::testing {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;
namespace cmv1 = ::dsa::common::v1;

namespace {

absl::Status Unreachable(const std::string& address) {
  return absl::UnavailableError(absl::StrCat("failed to connect to ", address, " (fake: down)"));
}

// INVALID_ARGUMENT unless every id of `tokens` is in [0, vocab_size).
absl::Status CheckTokens(const google::protobuf::RepeatedField<int32_t>& tokens,
                         int32_t vocab_size) {
  for (int i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "] = ", tokens[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

FakeAttentionShape TinyModelShape(int64_t max_context) {
  FakeAttentionShape shape;
  shape.model = "tiny";
  shape.vocab_size = kTinyVocab;
  shape.eos_token_id = kTinyEos;
  shape.max_context = max_context;
  return shape;
}

// What a call to `w` at `address` answers before it is looked at: UNAVAILABLE for no worker or a
// down one, DEADLINE_EXCEEDED for a hung one, else OK.
absl::Status FakeWorkers::Gone(const Worker* w, const std::string& address) {
  if (w == nullptr || w->down) return Unreachable(address);
  if (w->hung || w->stalled) return absl::DeadlineExceededError("Deadline Exceeded (fake: hung)");
  return absl::OkStatus();
}

absl::Status FakeWorkers::WaitWhileStalled(const std::string& address, const WorkerCall& call) {
  Worker* w = Find(address, true);
  if (w == nullptr || !w->stalled) return absl::OkStatus();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  ++w->stalled_calls;
  absl::Status status;
  while (w->stalled) {
    // The predicate may take the engine's locks: not under ours.
    mu_.Unlock();
    const bool cancelled = call.cancelled && call.cancelled();
    mu_.Lock();
    if (cancelled) {
      ++w->cancelled_calls;
      status = absl::CancelledError("Cancelled (fake: cancelled while stalled)");
      break;
    }
    if (absl::Now() > give_up) {
      status = absl::DeadlineExceededError("Deadline Exceeded (fake: stalled for 20 s)");
      break;
    }
    stall_changed_.WaitWithTimeout(&mu_, absl::Milliseconds(1));
  }
  --w->stalled_calls;
  return status;
}

// Drops the sequences `ids` of `w` whose lease ended, as the worker's sweep releases them; an
// attention worker's go on its indexer too (the real one releases them there).
void FakeWorkers::DropLocked(Worker* w, const std::vector<uint64_t>& ids) {
  for (const uint64_t id : ids) {
    auto it = w->sequences.find(id);
    if (it == w->sequences.end()) continue;
    if (w->attention) {
      auto found = indexers_.find(it->second.indexer);
      if (found != indexers_.end() && !found->second.down) {
        found->second.sequences.erase(id);
        found->second.leases->Detach(id);
      }
    }
    w->sequences.erase(it);
  }
}

// What a worker's RenewLease answers: the renewal by its lease table, the sequences of the lease
// that ended dropped.
absl::Status FakeWorkers::RenewLocked(const std::string& address, bool attention,
                                      const cmv1::Lease& lease, cmv1::LeaseState* state) {
  Worker* w = Find(address, attention);
  if (w != nullptr) ++w->renew_lease_calls;
  if (absl::Status gone = Gone(w, address); !gone.ok()) return gone;
  if (!w->renewal_failure.ok()) return w->renewal_failure;
  absl::StatusOr<SequenceLeases::Renewal> renewal = w->leases->Renew(DecodeLease(lease), "");
  if (!renewal.ok()) return renewal.status();
  DropLocked(w, renewal->released);
  state->set_renewed(renewal->renewed);
  state->set_sequences(renewal->sequences);
  state->set_superseded_released(renewal->superseded);
  w->renewals.push_back(lease);
  return absl::OkStatus();
}

class FakeAttentionClient final : public AttentionWorkerClient {
 public:
  FakeAttentionClient(std::shared_ptr<FakeWorkers> fakes, std::string address)
      : fakes_(std::move(fakes)), address_(std::move(address)) {}

  WorkerReadiness CheckReadiness(absl::Duration /*timeout*/) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) {
      return {false, absl::StrCat("its health check failed: ", gone.message()),
              gone.code() == absl::StatusCode::kDeadlineExceeded};
    }
    if (w->health_hung) {
      return {false, "its health check failed: Deadline Exceeded (fake: health hung)", true};
    }
    if (w->not_ready) return {false, "its readiness is not SERVING (draining?)"};
    return {true, ""};
  }

  absl::Status GetInfo(const WorkerCall& call, av1::GetInfoResponse* response) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    if (absl::Status failed = fakes_->ConnectLocked(w, address_, call); !failed.ok()) {
      return failed;
    }
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    response->set_num_full_layers(w->shape.num_full_layers);
    response->set_num_heads(w->shape.num_heads);
    response->set_head_dim(w->shape.head_dim);
    response->set_kv_capacity_slots(w->shape.kv_capacity_slots);
    response->set_instance_id(absl::StrCat(address_, "#", w->instance));
    response->set_model(w->shape.model);
    response->set_vocab_size(w->shape.vocab_size);
    response->set_eos_token_id(w->shape.eos_token_id);
    response->set_max_context(w->shape.max_context);
    return absl::OkStatus();
  }

  absl::Status Prefill(const WorkerCall& call, const av1::PrefillRequest& request,
                       av1::PrefillResponse* response) override {
    absl::MutexLock lock(&fakes_->mu_);
    if (FakeWorkers::Worker* w = fakes_->Find(address_, true)) ++w->prefill_calls;
    if (absl::Status held = fakes_->WaitWhileStalled(address_, call); !held.ok()) return held;
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    FakeWorkers::Worker* indexer = fakes_->Find(request.indexer_worker(), false);
    if (!FakeWorkers::Gone(indexer, request.indexer_worker()).ok()) {
      return absl::UnavailableError(
          absl::StrCat("indexer worker ", request.indexer_worker(), " unreachable"));
    }
    if (indexer->attention_cannot_reach && !request.continue_sequence()) {
      // What the attention worker answers when its connection to a restarted indexer is still
      // in its reconnection backoff.
      return absl::UnavailableError(absl::StrCat("indexer worker ", request.indexer_worker(),
                                                 ": GetLoad: failed to connect to all addresses"));
    }
    if (!request.continue_sequence() && w->sequences.contains(request.sequence_id())) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", request.sequence_id()));
    }
    // The lease first, so that a refused one creates nothing (here or on the indexer).
    const SequenceLease lease = DecodeLease(request.lease());
    if (absl::Status refused = w->leases->Check(lease, ""); !refused.ok()) return refused;
    if (!request.continue_sequence()) {
      if (absl::Status refused = indexer->leases->Check(lease, ""); !refused.ok()) return refused;
    }
    // The indexer's CreateSequence refusal (indexer_service/indexer.cc), answered unchanged.
    const iv1::SpinSettings& spin = request.settings().spin();
    if (!request.continue_sequence() && indexer->without_audits && !spin.all_keep() &&
        spin.miss_target() > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "miss target ", spin.miss_target(),
          " needs audits: this indexer runs with audit_fraction 0 (dsa-indexer --audit-fraction)"));
    }
    const int32_t vocab = w->shape.vocab_size;
    if (vocab > 0) {  // the tiny real model: the new slots' tokens
      auto it = w->sequences.find(request.sequence_id());
      const int64_t held = it == w->sequences.end() ? 0 : it->second.length;
      if (request.continue_sequence() && it == w->sequences.end()) {
        return absl::NotFoundError(absl::StrCat("no sequence ", request.sequence_id()));
      }
      if (request.tokens_size() != request.context_length() - held) {
        return absl::InvalidArgumentError(absl::StrCat(request.tokens_size(), " tokens for slots ",
                                                       held, "..", request.context_length()));
      }
      if (absl::Status bad = CheckTokens(request.tokens(), vocab); !bad.ok()) return bad;
    }
    FakeWorkers::Sequence& s = w->sequences[request.sequence_id()];
    s.length = request.context_length();
    s.pending_rows = 0;
    s.indexer = request.indexer_worker();
    if (vocab > 0) {
      s.kv.insert(s.kv.end(), request.tokens().begin(), request.tokens().end());
      s.sampling = request.sampling();
      response->set_next_token(TinyModelNext(s.kv, vocab, s.sampling));
    }
    indexer->sequences[request.sequence_id()].length = request.context_length();
    if (auto held = w->leases->Attach(request.sequence_id(), lease, ""); held.ok()) {
      fakes_->DropLocked(w, held->released);
    }
    if (!request.continue_sequence()) {
      if (auto held = indexer->leases->Attach(request.sequence_id(), lease, ""); held.ok()) {
        fakes_->DropLocked(indexer, held->released);
      }
    }
    w->prefills.push_back(request);
    response->set_seconds(0.001);
    return absl::OkStatus();
  }

  absl::Status DecodeStep(const WorkerCall& call, const av1::DecodeStepRequest& request,
                          av1::DecodeStepResponse* response) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    if (w != nullptr) ++w->decode_steps;
    if (absl::Status held = fakes_->WaitWhileStalled(address_, call); !held.ok()) return held;
    w = fakes_->Find(address_, true);
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    // The contract: the batch fails as a whole and nothing advances.
    for (const av1::SequenceStep& step : request.sequences()) {
      auto it = w->sequences.find(step.sequence_id());
      if (it == w->sequences.end()) {
        return absl::NotFoundError(absl::StrCat("no sequence ", step.sequence_id()));
      }
      if (it->second.broken) {
        return absl::FailedPreconditionError(
            absl::StrCat("sequence ", step.sequence_id(), " is broken (fake); release it"));
      }
      const FakeWorkers::Worker* indexer = fakes_->Find(it->second.indexer, false);
      if (!FakeWorkers::Gone(indexer, it->second.indexer).ok() ||
          !indexer->sequences.contains(step.sequence_id())) {
        return absl::UnavailableError(
            absl::StrCat("indexer worker ", it->second.indexer, " failed the select"));
      }
      if (w->shape.vocab_size > 0) {
        if (it->second.pending_rows > 1) {
          return absl::FailedPreconditionError("a step awaits Commit");
        }
        if (step.tokens_size() != step.rows()) {
          return absl::InvalidArgumentError(
              absl::StrCat(step.tokens_size(), " tokens for ", step.rows(), " rows"));
        }
        if (absl::Status bad = CheckTokens(step.tokens(), w->shape.vocab_size); !bad.ok()) {
          return bad;
        }
      } else if (step.tokens_size() > 0) {
        return absl::InvalidArgumentError("tokens for the pattern model");
      }
    }
    w->steps.push_back(request);
    for (const av1::SequenceStep& step : request.sequences()) {
      FakeWorkers::Sequence& s = w->sequences[step.sequence_id()];
      av1::SequenceStepResult* result = response->add_sequences();
      result->set_sequence_id(step.sequence_id());
      result->set_first_position(s.length);
      result->set_blocks_scored(1);
      result->set_blocks_visible(1);
      if (w->shape.vocab_size > 0) {
        // Row r sees the KV and the rows' tokens up to its own.
        std::vector<int32_t> seen = s.kv;
        for (int r = 0; r < step.rows(); ++r) {
          seen.push_back(step.tokens(r));
          result->add_sampled_tokens(TinyModelNext(seen, w->shape.vocab_size, s.sampling));
        }
      }
      if (step.rows() > 1) {
        s.pending_rows = step.rows();
        s.pending_tokens.assign(step.tokens().begin(), step.tokens().end());
      } else {
        s.length += 1;
        if (step.tokens_size() > 0) s.kv.push_back(step.tokens(0));
      }
    }
    if (w->stall_after_step) {
      w->stall_after_step = false;
      w->stalled = true;
    }
    return absl::OkStatus();
  }

  std::vector<absl::Status> Commit(absl::Duration /*timeout*/,
                                   const std::vector<TracedCommit>& commits,
                                   const std::function<bool()>& cancelled) override {
    absl::MutexLock lock(&fakes_->mu_);
    WorkerCall call;
    call.cancelled = cancelled;
    if (absl::Status held = fakes_->WaitWhileStalled(address_, call); !held.ok()) {
      return std::vector<absl::Status>(commits.size(), held);
    }
    std::vector<absl::Status> out;
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    for (const TracedCommit& commit : commits) {
      if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) {
        out.push_back(gone);
        continue;
      }
      auto it = w->sequences.find(commit.request.sequence_id());
      if (it == w->sequences.end() || it->second.pending_rows <= 1 ||
          commit.request.accepted() < 0 || commit.request.accepted() >= it->second.pending_rows) {
        out.push_back(absl::FailedPreconditionError("no speculative step to commit"));
        continue;
      }
      it->second.length += commit.request.accepted() + 1;
      it->second.pending_rows = 0;
      if (!it->second.pending_tokens.empty()) {
        it->second.kv.insert(it->second.kv.end(), it->second.pending_tokens.begin(),
                             it->second.pending_tokens.begin() + commit.request.accepted() + 1);
        it->second.pending_tokens.clear();
      }
      w->commits.push_back(commit.request);
      out.push_back(absl::OkStatus());
    }
    return out;
  }

  absl::Status Release(const WorkerCall& /*call*/, const av1::ReleaseRequest& request) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, true);
    if (w != nullptr) ++w->release_calls;
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    auto it = w->sequences.find(request.sequence_id());
    if (it == w->sequences.end()) {
      return absl::NotFoundError(absl::StrCat("no sequence ", request.sequence_id()));
    }
    const std::string indexer_address = it->second.indexer;
    w->sequences.erase(it);
    w->leases->Detach(request.sequence_id());
    w->released.push_back(request.sequence_id());
    if (request.keep_indexer_sequence()) return absl::OkStatus();
    FakeWorkers::Worker* indexer = fakes_->Find(indexer_address, false);
    if (!FakeWorkers::Gone(indexer, indexer_address).ok()) {
      return absl::UnavailableError(
          absl::StrCat("indexer worker ", indexer_address, " unreachable: its sequence is kept"));
    }
    if (indexer->sequences.erase(request.sequence_id()) > 0) {
      indexer->leases->Detach(request.sequence_id());
      indexer->released.push_back(request.sequence_id());
    }
    return absl::OkStatus();
  }

  absl::Status RenewLease(const WorkerCall& /*call*/, const cmv1::Lease& lease,
                          cmv1::LeaseState* state) override {
    absl::MutexLock lock(&fakes_->mu_);
    return fakes_->RenewLocked(address_, /*attention=*/true, lease, state);
  }

 private:
  std::shared_ptr<FakeWorkers> fakes_;
  std::string address_;
};

class FakeIndexerClient final : public IndexerWorkerClient {
 public:
  FakeIndexerClient(std::shared_ptr<FakeWorkers> fakes, std::string address)
      : fakes_(std::move(fakes)), address_(std::move(address)) {}

  WorkerReadiness CheckReadiness(absl::Duration /*timeout*/) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, false);
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) {
      return {false, absl::StrCat("its health check failed: ", gone.message()),
              gone.code() == absl::StatusCode::kDeadlineExceeded};
    }
    if (w->health_hung) {
      return {false, "its health check failed: Deadline Exceeded (fake: health hung)", true};
    }
    if (w->not_ready) return {false, "its readiness is not SERVING (draining?)"};
    return {true, ""};
  }

  absl::Status GetLoad(const WorkerCall& call, iv1::GetLoadResponse* response) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, false);
    if (w != nullptr) ++w->get_loads;
    if (absl::Status failed = fakes_->ConnectLocked(w, address_, call); !failed.ok()) {
      return failed;
    }
    if (w != nullptr) {
      ++w->held_get_loads;
      fakes_->mu_.Await(absl::Condition(
          +[](FakeWorkers::Worker* held) { return !held->hold_get_loads; }, w));
      --w->held_get_loads;
    }
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    response->set_capacity_blocks(w->capacity_blocks);
    response->set_used_blocks(static_cast<int64_t>(w->sequences.size()));
    response->set_sequences(static_cast<int64_t>(w->sequences.size()));
    response->set_num_heads(w->shape.num_heads);
    response->set_head_dim(w->shape.head_dim);
    response->set_instance_id(absl::StrCat(address_, "#", w->instance));
    return absl::OkStatus();
  }

  absl::Status Release(const WorkerCall& /*call*/, const iv1::ReleaseRequest& request) override {
    absl::MutexLock lock(&fakes_->mu_);
    FakeWorkers::Worker* w = fakes_->Find(address_, false);
    if (w != nullptr) ++w->release_calls;
    if (absl::Status gone = FakeWorkers::Gone(w, address_); !gone.ok()) return gone;
    if (w->sequences.erase(request.sequence_id()) == 0) {
      return absl::NotFoundError(absl::StrCat("no sequence ", request.sequence_id()));
    }
    w->leases->Detach(request.sequence_id());
    w->released.push_back(request.sequence_id());
    return absl::OkStatus();
  }

  absl::Status RenewLease(const WorkerCall& /*call*/, const cmv1::Lease& lease,
                          cmv1::LeaseState* state) override {
    absl::MutexLock lock(&fakes_->mu_);
    return fakes_->RenewLocked(address_, /*attention=*/false, lease, state);
  }

 private:
  std::shared_ptr<FakeWorkers> fakes_;
  std::string address_;
};

FakeWorkers::Worker* FakeWorkers::Find(const std::string& address, bool attention) {
  auto& workers = attention ? attention_ : indexers_;
  auto it = workers.find(address);
  if (it == workers.end()) return nullptr;
  Worker* w = &it->second;
  // A down worker's sweep is not seen until it answers again (then it has run).
  if (!w->down) DropLocked(w, w->leases->TakeExpired());
  return w;
}

void FakeWorkers::AddAttention(const std::string& address, AttentionShape shape) {
  absl::MutexLock lock(&mu_);
  Worker& w = attention_[address];
  w.attention = true;
  w.shape = std::move(shape);
  w.leases = std::make_unique<SequenceLeases>(clock_);
}

void FakeWorkers::AddIndexer(const std::string& address, int64_t capacity_blocks, int64_t num_heads,
                             int64_t head_dim) {
  absl::MutexLock lock(&mu_);
  Worker& w = indexers_[address];
  w.capacity_blocks = capacity_blocks;
  w.leases = std::make_unique<SequenceLeases>(clock_);
  w.shape.num_heads = num_heads;
  w.shape.head_dim = head_dim;
}

void FakeWorkers::SetDown(const std::string& address, bool down) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) w->down = down;
  }
}

void FakeWorkers::FailConnects(const std::string& address, int count) {
  absl::MutexLock lock(&mu_);
  connect_failures_[address] = count;
}

int FakeWorkers::ChecksWaitingForReady(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = checks_waiting_for_ready_.find(address);
  return it == checks_waiting_for_ready_.end() ? 0 : it->second;
}

absl::Status FakeWorkers::ConnectLocked(const Worker* w, const std::string& address,
                                        const WorkerCall& call) {
  if (call.wait_for_ready) ++checks_waiting_for_ready_[address];
  auto it = connect_failures_.find(address);
  const bool fails = it != connect_failures_.end() && it->second > 0;
  if (fails) --it->second;
  if (call.wait_for_ready && (fails || w == nullptr || w->down)) {
    return absl::DeadlineExceededError("Deadline Exceeded (fake: waited for a connection)");
  }
  if (!fails) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("failed to connect to all addresses; last error: "
                   "UNKNOWN: ipv4:",
                   address, ": No such file or directory (fake)"));
}

void FakeWorkers::SetHung(const std::string& address, bool hung) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) w->hung = hung;
  }
}

void FakeWorkers::SetStalled(const std::string& address, bool stalled) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) w->stalled = stalled;
  }
  stall_changed_.SignalAll();
}

void FakeWorkers::StallAfterNextStep(const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = Find(address, true)) w->stall_after_step = true;
}

bool FakeWorkers::AwaitStalledCalls(const std::string& address, int count, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  if (w == nullptr) return false;
  auto stalled = [w, count] { return w->stalled_calls >= count; };
  return mu_.AwaitWithTimeout(absl::Condition(&stalled), timeout);
}

int FakeWorkers::CancelledCalls(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? 0 : w->cancelled_calls;
}

void FakeWorkers::HoldGetLoads(const std::string& address, bool hold) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = Find(address, false)) w->hold_get_loads = hold;
}

bool FakeWorkers::AwaitHeldGetLoads(const std::string& address, int count, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, false);
  if (w == nullptr) return false;
  auto held = [w, count] { return w->held_get_loads >= count; };
  return mu_.AwaitWithTimeout(absl::Condition(&held), timeout);
}

void FakeWorkers::SetNotReady(const std::string& address, bool not_ready) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) w->not_ready = not_ready;
  }
}

void FakeWorkers::SetHealthHung(const std::string& address, bool hung, bool indexer_only) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (kind && indexer_only) continue;
    if (Worker* w = Find(address, kind)) w->health_hung = hung;
  }
}

void FakeWorkers::Restart(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) {
      ++w->instance;
      w->sequences.clear();
      w->leases = std::make_unique<SequenceLeases>(clock_);
      w->down = false;
      w->hung = false;
      w->stalled = false;
      w->stall_after_step = false;
    }
  }
}

void FakeWorkers::SetBroken(const std::string& address, uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  if (w == nullptr) return;
  auto it = w->sequences.find(sequence_id);
  if (it != w->sequences.end()) it->second.broken = true;
}

void FakeWorkers::SetUnreachableFromAttention(const std::string& address, bool unreachable) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = Find(address, false)) w->attention_cannot_reach = unreachable;
}

void FakeWorkers::SetWithoutAudits(const std::string& address, bool without_audits) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = Find(address, false)) w->without_audits = without_audits;
}

int FakeWorkers::Sequences(const std::string& address) {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) n += static_cast<int>(w->sequences.size());
  }
  return n;
}

std::vector<uint64_t> FakeWorkers::Released(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> out;
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind))
      out.insert(out.end(), w->released.begin(), w->released.end());
  }
  return out;
}

int FakeWorkers::ReleaseCalls(const std::string& address) {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) n += w->release_calls;
  }
  return n;
}

int FakeWorkers::DecodeSteps(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? 0 : w->decode_steps;
}

int FakeWorkers::GetLoads(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, false);
  return w == nullptr ? 0 : w->get_loads;
}

int FakeWorkers::PrefillCalls(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? 0 : w->prefill_calls;
}

std::vector<av1::PrefillRequest> FakeWorkers::Prefills(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? std::vector<av1::PrefillRequest>{} : w->prefills;
}

std::vector<av1::DecodeStepRequest> FakeWorkers::Steps(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? std::vector<av1::DecodeStepRequest>{} : w->steps;
}

std::vector<av1::CommitRequest> FakeWorkers::Commits(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  return w == nullptr ? std::vector<av1::CommitRequest>{} : w->commits;
}

void FakeWorkers::FailRenewals(const std::string& address, const absl::Status& failure) {
  absl::MutexLock lock(&mu_);
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) w->renewal_failure = failure;
  }
}

std::vector<cmv1::Lease> FakeWorkers::Renewals(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::vector<cmv1::Lease> out;
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind))
      out.insert(out.end(), w->renewals.begin(), w->renewals.end());
  }
  return out;
}

int FakeWorkers::RenewLeaseCalls(const std::string& address) {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (bool kind : {true, false}) {
    if (Worker* w = Find(address, kind)) n += w->renew_lease_calls;
  }
  return n;
}

std::vector<int32_t> FakeWorkers::KvTokens(const std::string& address, uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  Worker* w = Find(address, true);
  if (w == nullptr) return {};
  auto it = w->sequences.find(sequence_id);
  return it == w->sequences.end() ? std::vector<int32_t>{} : it->second.kv;
}

std::shared_ptr<AttentionWorkerClient> FakeWorkers::Attention(const std::string& address) {
  return std::make_shared<FakeAttentionClient>(shared_from_this(), address);
}

std::shared_ptr<IndexerWorkerClient> FakeWorkers::Indexer(const std::string& address) {
  return std::make_shared<FakeIndexerClient>(shared_from_this(), address);
}

}  // namespace dsa::testing
