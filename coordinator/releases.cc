// The coordinator's Releases of sequences on its workers (see releases.h).
#include "coordinator/releases.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/worker_clients.h"
#include "dsa/attention/v1/attention.pb.h"
#include "dsa/indexer/v1/indexer.pb.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

}  // namespace

SequenceReleases::SequenceReleases(EngineCore* core, WorkerPool* pool) : core_(core), pool_(pool) {}

std::vector<Eviction> SequenceReleases::ReleaseFinished(int attention, int indexer,
                                                        uint64_t sequence_id,
                                                        bool keep_indexer_sequence,
                                                        bool indexer_too, absl::Duration timeout,
                                                        const TraceContext* trace) {
  std::vector<Unreleased> unreached = ReleaseSequence(
      attention, indexer, sequence_id, keep_indexer_sequence, indexer_too, timeout, trace);
  absl::MutexLock lock(&core_->mu);
  const int undelivered = static_cast<int>(unreached.size());
  unreleased_.insert(unreleased_.end(), unreached.begin(), unreached.end());
  if (undelivered > 0) {
    undelivered_[sequence_id] = undelivered;  // ReleaseDone once delivered (RetryUnreleased)
    return {};
  }
  return core_->scheduler.ReleaseDone(sequence_id);
}

absl::Status SequenceReleases::ReleaseOnWorker(bool attention, int slot, uint64_t sequence_id,
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

std::vector<SequenceReleases::Unreleased> SequenceReleases::ReleaseSequence(
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

void SequenceReleases::CarryOutEvictions(const std::vector<Eviction>& evictions) {
  // The scheduler has forgotten these sequences already. A worker that lost the sequence freed
  // it, but one that could not be reached may still hold it: its Release is retried when that
  // address answers again (RetryUnreleased, which sends it on to a restarted worker's new
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

bool SequenceReleases::RetryUnreleased() {
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
  if (done.empty()) return false;
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
  return true;
}

}  // namespace dsa
