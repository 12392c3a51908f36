// The coordinator's admission and placement logic (see scheduler.h).
#include "coordinator/scheduler.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace dsa {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

absl::StatusOr<absl::flat_hash_map<std::string, int>> ParseCallerWeights(
    absl::Span<const std::string> entries) {
  absl::flat_hash_map<std::string, int> weights;
  for (const std::string& entry : entries) {
    const size_t eq = entry.rfind('=');
    int weight = 0;
    if (eq == std::string::npos || eq == 0 ||
        !absl::SimpleAtoi(absl::string_view(entry).substr(eq + 1), &weight) || weight < 1 ||
        weight > 1000000) {
      return absl::InvalidArgumentError(absl::StrCat(
          "caller weight '", entry, "' is not NAME=W with W an integer in [1, 1000000]"));
    }
    if (!weights.emplace(entry.substr(0, eq), weight).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("caller '", entry.substr(0, eq), "' is given a weight twice"));
    }
  }
  return weights;
}

std::string SessionKey(const SequenceDemand& demand) {
  if (demand.session_id.empty()) return "";
  return absl::StrCat(demand.caller.size(), ":", demand.caller, demand.session_id);
}

absl::StatusOr<Scheduler> Scheduler::Create(const SchedulerOptions& options,
                                            std::vector<IndexerWorkerInfo> indexers,
                                            std::vector<AttentionWorkerInfo> attentions) {
  if (options.num_full_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_full_layers must be >= 1, got ", options.num_full_layers));
  }
  if (options.max_queue < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue must be >= 0, got ", options.max_queue));
  }
  if (options.max_running_per_attention < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_running_per_attention must be >= 1, got ",
                                                   options.max_running_per_attention));
  }
  if (options.max_queued_per_caller < -1 || options.max_running_per_caller < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queued_per_caller and max_running_per_caller must be >= -1, got ",
                     options.max_queued_per_caller, " and ", options.max_running_per_caller));
  }
  for (const auto& [caller, weight] : options.caller_weights) {
    if (weight < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("caller '", caller, "' has weight ", weight, "; weights must be >= 1"));
    }
  }
  if (options.first_sequence_id == 0) {
    return absl::InvalidArgumentError("first_sequence_id must be >= 1");
  }
  if (options.colocated && indexers.size() != attentions.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "co-located workers pair indexer worker i with attention worker i, but there are ",
        indexers.size(), " indexer and ", attentions.size(), " attention workers"));
  }
  for (size_t i = 0; options.colocated && i < indexers.size(); ++i) {
    if (indexers[i].address != attentions[i].address) {
      return absl::InvalidArgumentError(absl::StrCat(
          "co-located workers pair indexer worker i with attention worker i at the same address, "
          "but indexer ",
          i, " is ", indexers[i].address, " and attention worker ", i, " is ",
          attentions[i].address));
    }
  }
  for (const IndexerWorkerInfo& info : indexers) {
    if (info.capacity_blocks < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("indexer worker ", info.address, " has a negative capacity"));
    }
  }
  return Scheduler(options, std::move(indexers), std::move(attentions));
}

Scheduler::Scheduler(SchedulerOptions options, std::vector<IndexerWorkerInfo> indexers,
                     std::vector<AttentionWorkerInfo> attentions)
    : options_(std::move(options)),
      indexer_info_(std::move(indexers)),
      attention_info_(std::move(attentions)),
      indexers_(indexer_info_.size()),
      attentions_(attention_info_.size()),
      next_sequence_id_(options_.first_sequence_id) {}

absl::StatusOr<int> Scheduler::AddIndexer(IndexerWorkerInfo info) {
  if (info.capacity_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("indexer worker ", info.address, " has a negative capacity"));
  }
  if (options_.colocated && indexer_info_.size() != attention_info_.size()) {
    return absl::FailedPreconditionError(
        "co-located workers are added in pairs: indexer worker i, then attention worker i");
  }
  indexer_info_.push_back(std::move(info));
  indexers_.emplace_back();
  return static_cast<int>(indexer_info_.size()) - 1;
}

absl::StatusOr<int> Scheduler::AddAttention(AttentionWorkerInfo info) {
  if (options_.colocated) {
    if (attention_info_.size() + 1 != indexer_info_.size()) {
      return absl::FailedPreconditionError(
          "co-located workers are added in pairs: indexer worker i, then attention worker i");
    }
    if (indexer_info_.back().address != info.address) {
      return absl::InvalidArgumentError(absl::StrCat("co-located attention worker ", info.address,
                                                     " must have its indexer's address ",
                                                     indexer_info_.back().address));
    }
  }
  attention_info_.push_back(std::move(info));
  attentions_.emplace_back();
  return static_cast<int>(attention_info_.size()) - 1;
}

absl::Status Scheduler::SetIndexerReady(int indexer, bool ready) {
  if (indexer < 0 || indexer >= static_cast<int>(indexers_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no indexer worker ", indexer));
  }
  if (ready && indexers_[indexer].retired) {
    return absl::FailedPreconditionError(absl::StrCat("indexer worker ", indexer, " is retired"));
  }
  indexers_[indexer].ready = ready;
  return absl::OkStatus();
}

absl::Status Scheduler::SetAttentionReady(int attention, bool ready) {
  if (attention < 0 || attention >= static_cast<int>(attentions_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no attention worker ", attention));
  }
  if (ready && attentions_[attention].retired) {
    return absl::FailedPreconditionError(
        absl::StrCat("attention worker ", attention, " is retired"));
  }
  attentions_[attention].ready = ready;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Eviction>> Scheduler::RetireIndexer(int indexer) {
  if (indexer < 0 || indexer >= static_cast<int>(indexers_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no indexer worker ", indexer));
  }
  indexers_[indexer].ready = false;
  indexers_[indexer].retired = true;
  return ForgetRetainedOn(indexer, -1);
}

absl::StatusOr<std::vector<Eviction>> Scheduler::RetireAttention(int attention) {
  if (attention < 0 || attention >= static_cast<int>(attentions_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no attention worker ", attention));
  }
  attentions_[attention].ready = false;
  attentions_[attention].retired = true;
  return ForgetRetainedOn(-1, attention);
}

std::vector<Eviction> Scheduler::ForgetRetainedOn(int indexer, int attention) {
  std::vector<uint64_t> forget;
  for (auto& [id, s] : sequences_) {
    if (s.indexer != indexer && s.attention != attention) continue;
    if (!s.session_key.empty()) {  // its next turn starts afresh
      auto session = session_sequences_.find(s.session_key);
      if (session != session_sequences_.end() && session->second == id) {
        session_sequences_.erase(session);
      }
      if (s.state == State::kRetained) {
        s.session_key.clear();
        s.history.clear();
      }
    }
    if (s.state != State::kRetained) continue;
    if (s.pins > 0) {
      s.release_when_unpinned = true;  // dropped when the prefill that uses it ends
    } else {
      forget.push_back(id);
    }
  }
  std::vector<Eviction> evictions;
  for (uint64_t id : forget) {
    evictions.push_back(Evict(id));
    evictions.back().release_on_both = true;
  }
  return evictions;
}

bool Scheduler::FitsAReadyWorker(const SequenceDemand& demand) const {
  bool indexer_fits = false;
  for (size_t i = 0; i < indexers_.size(); ++i) {
    indexer_fits |= indexers_[i].ready && BlocksNeeded(demand) <= indexer_info_[i].capacity_blocks;
  }
  bool attention_fits = false;
  for (size_t j = 0; j < attentions_.size(); ++j) {
    const int64_t capacity = attention_info_[j].kv_capacity_slots;
    attention_fits |= attentions_[j].ready && (capacity <= 0 || KvSlots(demand) <= capacity);
  }
  return indexer_fits && attention_fits;
}

std::vector<uint64_t> Scheduler::TakeUnplaceableQueued() {
  std::vector<uint64_t> taken;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (FitsAReadyWorker(it->demand)) {
      ++it;
      continue;
    }
    taken.push_back(it->ticket);
    it = EraseQueued(it);
  }
  return taken;
}

int Scheduler::QueuedLimitPerCaller() const {
  if (options_.max_queued_per_caller >= 0) return options_.max_queued_per_caller;
  return std::max(1, options_.max_queue / 4);
}

int Scheduler::RunningLimitPerCaller() const {
  if (options_.max_running_per_caller >= 0) return options_.max_running_per_caller;
  const int slots = ReadyAttentions() * options_.max_running_per_attention;
  if (slots < 2) return 1;
  return slots - std::max(1, slots / 4);
}

bool Scheduler::BelowRunningLimit(const std::string& caller) const {
  const int limit = RunningLimitPerCaller();
  if (limit == 0) return true;
  auto it = callers_.find(caller);
  return it == callers_.end() || it->second.running < limit;
}

std::deque<Scheduler::Pending>::iterator Scheduler::NextEligible() {
  auto best = queue_.end();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (it->migrated) return it;  // migrated requests are at the head, in their order
    if (!BelowRunningLimit(it->demand.caller)) continue;
    if (best == queue_.end() ||
        std::tie(it->start_tag, it->arrival) < std::tie(best->start_tag, best->arrival)) {
      best = it;
    }
  }
  return best;
}

void Scheduler::TagArrival(Pending& pending) {
  auto weight = options_.caller_weights.find(pending.demand.caller);
  CallerState& caller = callers_[pending.demand.caller];
  pending.start_tag = std::max(virtual_time_, caller.last_finish);
  caller.last_finish =
      pending.start_tag +
      1.0 / (weight == options_.caller_weights.end() ? 1.0 : static_cast<double>(weight->second));
  pending.arrival = ++arrivals_;
}

void Scheduler::CountAdmitted(const std::string& caller, double start_tag) {
  ++callers_[caller].running;
  virtual_time_ = std::max(virtual_time_, start_tag);
}

void Scheduler::CountFinished(const std::string& caller) {
  auto it = callers_.find(caller);
  if (it == callers_.end()) return;
  --it->second.running;
  ForgetIdleCaller(caller);
}

void Scheduler::ForgetIdleCaller(const std::string& caller) {
  // A caller with nothing queued or running starts afresh at the virtual time when it comes back
  // (its start tag is max(virtual time, last finish) anyway once others were served), so idle
  // callers (one a peer on plaintext) cost no memory.
  auto it = callers_.find(caller);
  if (it != callers_.end() && it->second.queued == 0 && it->second.running == 0) {
    callers_.erase(it);
  }
}

std::deque<Scheduler::Pending>::iterator Scheduler::EraseQueued(std::deque<Pending>::iterator it) {
  if (!it->demand.session_id.empty()) busy_sessions_.erase(SessionKey(it->demand));
  const std::string caller = it->demand.caller;
  auto state = callers_.find(caller);
  if (state != callers_.end()) --state->second.queued;
  it = queue_.erase(it);
  ForgetIdleCaller(caller);
  return it;
}

absl::Status Scheduler::SetNumFullLayers(int num_full_layers) {
  if (num_full_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_full_layers must be >= 1, got ", num_full_layers));
  }
  if (!sequences_.empty() || !queue_.empty()) {
    return absl::FailedPreconditionError(
        "num_full_layers can change only while no sequence is held and none is queued");
  }
  options_.num_full_layers = num_full_layers;
  return absl::OkStatus();
}

int Scheduler::ReadyIndexers() const {
  return static_cast<int>(
      std::count_if(indexers_.begin(), indexers_.end(), [](const auto& i) { return i.ready; }));
}

int Scheduler::ReadyAttentions() const {
  return static_cast<int>(
      std::count_if(attentions_.begin(), attentions_.end(), [](const auto& a) { return a.ready; }));
}

int64_t Scheduler::BlocksPerLayer(const SequenceDemand& demand) const {
  return CeilDiv(demand.context_length + demand.max_new_tokens + demand.draft_length, kBlockSize);
}

int64_t Scheduler::BlocksNeeded(const SequenceDemand& demand) const {
  return options_.num_full_layers * BlocksPerLayer(demand);
}

int64_t Scheduler::KvSlots(const SequenceDemand& demand) const {
  return demand.context_length + demand.max_new_tokens + demand.draft_length;
}

int64_t Scheduler::FreeBlocks(int indexer) const {
  return indexer_info_[indexer].capacity_blocks -
         options_.num_full_layers * static_cast<int64_t>(indexers_[indexer].block_refs.size());
}

int64_t Scheduler::FreeKv(int attention) const {
  return attention_info_[attention].kv_capacity_slots - attentions_[attention].kv_reserved_slots;
}

absl::StatusOr<std::optional<Admission>> Scheduler::Submit(
    uint64_t ticket, const SequenceDemand& demand, bool migrated,
    absl::Span<const int32_t> context_tokens) {
  const std::string session = SessionKey(demand);
  const Sequence* session_sequence = nullptr;
  if (!session.empty()) {
    if (busy_sessions_.contains(session)) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", demand.session_id, "' has a turn queued or running"));
    }
    auto it = session_sequences_.find(session);
    if (it != session_sequences_.end()) {
      session_sequence = &sequences_.at(it->second);
      if (session_sequence->length > demand.context_length) {
        return absl::InvalidArgumentError(
            absl::StrCat("session '", demand.session_id, "' holds ", session_sequence->length,
                         " slots (previous context + generated tokens); context_length ",
                         demand.context_length, " must be at least that"));
      }
      const std::vector<int32_t>& history = session_sequence->history;
      if (!history.empty()) {
        const auto differ = std::mismatch(history.begin(), history.end(), context_tokens.begin(),
                                          context_tokens.end())
                                .first;
        if (differ != history.end()) {
          const size_t position = static_cast<size_t>(differ - history.begin());
          return absl::InvalidArgumentError(absl::StrCat(
              "session '", demand.session_id, "': context_tokens must start with the session's ",
              history.size(), " tokens (previous context + generated tokens); position ", position,
              " differs: ",
              position < context_tokens.size() ? absl::StrCat(context_tokens[position])
                                               : std::string("none"),
              ", the session has ", history[position]));
        }
      }
    }
  }
  const int64_t blocks = BlocksNeeded(demand);
  int64_t largest_blocks = 0;
  for (size_t i = 0; i < indexer_info_.size(); ++i) {
    if (!indexers_[i].retired) {
      largest_blocks = std::max(largest_blocks, indexer_info_[i].capacity_blocks);
    }
  }
  if (blocks > largest_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", blocks, " index-key-cache blocks (", options_.num_full_layers,
        " full layers x ", BlocksPerLayer(demand), " blocks of 64 slots for context ",
        demand.context_length, " + max_new_tokens ", demand.max_new_tokens, " + draft ",
        demand.draft_length,
        "), more than any indexer worker's capacity (largest: ", largest_blocks, " blocks)"));
  }
  int64_t largest_kv = 0;
  bool kv_unlimited = false;
  for (size_t j = 0; j < attention_info_.size(); ++j) {
    if (attentions_[j].retired) continue;
    kv_unlimited = kv_unlimited || attention_info_[j].kv_capacity_slots <= 0;
    largest_kv = std::max(largest_kv, attention_info_[j].kv_capacity_slots);
  }
  if (!kv_unlimited && KvSlots(demand) > largest_kv) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", KvSlots(demand),
        " KV slots, more than any attention worker's capacity (largest: ", largest_kv, " slots)"));
  }
  if (!FitsAReadyWorker(demand)) {
    return absl::UnavailableError(absl::StrCat(
        "no ready worker can hold the request now (", blocks, " index-key-cache blocks, ",
        KvSlots(demand), " KV slots): the workers large enough are not ready"));
  }
  if (session_sequence != nullptr && (!indexers_[session_sequence->indexer].ready ||
                                      !attentions_[session_sequence->attention].ready)) {
    session_sequence = nullptr;  // its workers are not ready: the turn starts afresh (TryPlace)
  }
  if (session_sequence != nullptr) {  // a turn stays on its session's workers
    const IndexerWorkerInfo& indexer = indexer_info_[session_sequence->indexer];
    const AttentionWorkerInfo& attention = attention_info_[session_sequence->attention];
    if (blocks > indexer.capacity_blocks) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session '", demand.session_id, "' turn needs ", blocks,
                       " index-key-cache blocks, more than its ", "indexer worker ",
                       indexer.address, " holds (", indexer.capacity_blocks, " blocks)"));
    }
    if (attention.kv_capacity_slots > 0 && KvSlots(demand) > attention.kv_capacity_slots) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session '", demand.session_id, "' turn needs ", KvSlots(demand),
                       " KV slots, more than its ", "attention worker ", attention.address,
                       " holds (", attention.kv_capacity_slots, " slots)"));
    }
  }
  if (migrated) {
    std::optional<Admission> admission = TryPlace(ticket, demand);
    if (admission.has_value()) {
      if (!session.empty()) busy_sessions_.insert(session);
      ++callers_[demand.caller].running;
      return admission;
    }
    Pending pending{ticket, demand};
    pending.migrated = true;
    queue_.push_front(std::move(pending));
    ++callers_[demand.caller].queued;
    if (!session.empty()) busy_sessions_.insert(session);
    return std::nullopt;
  }
  // The start tag it would get (TagArrival), not yet committed: a refused request leaves no trace.
  double start_tag = virtual_time_;
  if (auto it = callers_.find(demand.caller); it != callers_.end()) {
    start_tag = std::max(start_tag, it->second.last_finish);
  }
  auto next = NextEligible();
  if (BelowRunningLimit(demand.caller) &&
      (next == queue_.end() || (!next->migrated && start_tag < next->start_tag))) {
    std::optional<Admission> admission = TryPlace(ticket, demand);
    if (admission.has_value()) {
      if (!session.empty()) busy_sessions_.insert(session);
      Pending pending{ticket, demand};
      TagArrival(pending);
      CountAdmitted(demand.caller, pending.start_tag);
      return admission;
    }
  }
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", queue_.size(), " requests waiting (max_queue ", options_.max_queue, ")"));
  }
  const int queued_limit = QueuedLimitPerCaller();
  if (auto it = callers_.find(demand.caller);
      queued_limit > 0 && it != callers_.end() && it->second.queued >= queued_limit) {
    // Only this caller's own count and limit: nothing of what other callers have queued.
    return absl::ResourceExhaustedError(
        absl::StrCat("caller '", demand.caller, "' has ", it->second.queued,
                     " requests queued, its limit (--max-queued-per-caller ", queued_limit,
                     "); retry when one of them is admitted"));
  }
  Pending pending{ticket, demand};
  TagArrival(pending);
  ++callers_[demand.caller].queued;
  queue_.push_back(std::move(pending));
  if (!session.empty()) busy_sessions_.insert(session);
  return std::nullopt;
}

std::vector<Admission> Scheduler::AdmitQueued() {
  std::vector<Admission> admitted;
  while (true) {
    auto next = NextEligible();
    // The next in the fair order waits for room (as the head of a FIFO would), so that a large
    // request is not passed over forever by smaller ones.
    if (next == queue_.end()) break;
    std::optional<Admission> admission = TryPlace(next->ticket, next->demand);
    if (!admission.has_value()) break;
    CallerState& caller = callers_[next->demand.caller];
    --caller.queued;
    if (next->migrated) {
      ++caller.running;
    } else {
      CountAdmitted(next->demand.caller, next->start_tag);
    }
    queue_.erase(next);
    admitted.push_back(*std::move(admission));
  }
  return admitted;
}

bool Scheduler::CancelQueued(uint64_t ticket) {
  auto it = std::find_if(queue_.begin(), queue_.end(),
                         [ticket](const Pending& p) { return p.ticket == ticket; });
  if (it == queue_.end()) return false;
  EraseQueued(it);
  return true;
}

std::vector<uint64_t> Scheduler::CancelAllQueued() {
  std::vector<uint64_t> tickets;
  for (auto it = queue_.begin(); it != queue_.end();) {
    tickets.push_back(it->ticket);
    it = EraseQueued(it);
  }
  return tickets;
}

std::optional<std::vector<uint64_t>> Scheduler::PlanEvictions(int indexer, int64_t blocks,
                                                              int attention, int64_t kv,
                                                              uint64_t protect) const {
  if (attentions_[attention].running >= options_.max_running_per_attention) return std::nullopt;
  int64_t short_blocks = blocks - FreeBlocks(indexer);
  const bool kv_limited = attention_info_[attention].kv_capacity_slots > 0;
  int64_t short_kv = kv_limited ? kv - FreeKv(attention) : 0;
  std::vector<uint64_t> plan;
  if (short_blocks <= 0 && short_kv <= 0) return plan;
  std::vector<std::pair<uint64_t, uint64_t>> candidates;  // (last used, id)
  for (const auto& [id, s] : sequences_) {
    if (s.state == State::kRetained && s.pins == 0 && id != protect) {
      candidates.emplace_back(s.last_used, id);
    }
  }
  std::sort(candidates.begin(), candidates.end());
  absl::flat_hash_map<uint64_t, int> released;  // block id -> holders dropped by the plan
  const auto& refs = indexers_[indexer].block_refs;
  for (const auto& [unused_tick, id] : candidates) {
    const Sequence& s = sequences_.at(id);
    const bool frees_blocks = s.indexer == indexer && short_blocks > 0;
    const bool frees_kv = s.attention == attention && s.kv_slots > 0 && short_kv > 0;
    if (!frees_blocks && !frees_kv) continue;
    if (s.indexer == indexer) {
      int64_t freed = 0;
      for (uint64_t block : s.blocks) {
        int& dropped = released[block];
        if (refs.at(block) - dropped == 1) ++freed;
        ++dropped;
      }
      short_blocks -= freed * options_.num_full_layers;
    }
    if (s.attention == attention) short_kv -= s.kv_slots;
    plan.push_back(id);
    if (short_blocks <= 0 && short_kv <= 0) return plan;
  }
  return std::nullopt;
}

void Scheduler::DropBlocks(Sequence& sequence) {
  auto& refs = indexers_[sequence.indexer].block_refs;
  for (uint64_t block : sequence.blocks) {
    auto it = refs.find(block);
    if (--it->second == 0) refs.erase(it);
  }
  sequence.blocks.clear();
}

Eviction Scheduler::Evict(uint64_t sequence_id) {
  Sequence& s = sequences_.at(sequence_id);
  Eviction eviction{sequence_id, s.indexer, s.attention, s.kv_slots > 0};
  DropBlocks(s);
  attentions_[s.attention].kv_reserved_slots -= s.kv_slots;
  if (!s.session_key.empty()) {
    auto it = session_sequences_.find(s.session_key);
    if (it != session_sequences_.end() && it->second == sequence_id) session_sequences_.erase(it);
  }
  sequences_.erase(sequence_id);
  return eviction;
}

std::optional<Admission> Scheduler::TryPlace(uint64_t ticket, const SequenceDemand& demand) {
  const int64_t blocks_per_layer = BlocksPerLayer(demand);
  const int64_t kv = KvSlots(demand);
  const int layers = options_.num_full_layers;
  Admission admission;
  admission.ticket = ticket;

  auto session_it = demand.session_id.empty() ? session_sequences_.end()
                                              : session_sequences_.find(SessionKey(demand));
  if (session_it != session_sequences_.end()) {
    Sequence& kept = sequences_.at(session_it->second);
    if (!indexers_[kept.indexer].ready || !attentions_[kept.attention].ready) {
      // Its workers are not ready: the turn is placed afresh (the session's context is the whole
      // conversation, so nothing is lost). The kept sequence becomes a plain retained one, evicted
      // like any other once its workers are back.
      kept.session_key.clear();
      kept.history.clear();
      session_sequences_.erase(session_it);
      session_it = session_sequences_.end();
    }
  }
  if (session_it != session_sequences_.end()) {  // a new turn of a kept sequence
    const uint64_t id = session_it->second;
    Sequence& s = sequences_.at(id);
    const int64_t extra_blocks =
        std::max<int64_t>(0, blocks_per_layer - static_cast<int64_t>(s.blocks.size())) * layers;
    const int64_t extra_kv = std::max<int64_t>(0, kv - s.kv_slots);
    std::optional<std::vector<uint64_t>> plan =
        PlanEvictions(s.indexer, extra_blocks, s.attention, extra_kv, id);
    if (!plan.has_value()) return std::nullopt;
    for (uint64_t victim : *plan) admission.evictions.push_back(Evict(victim));
    auto& refs = indexers_[s.indexer].block_refs;
    while (static_cast<int64_t>(s.blocks.size()) > blocks_per_layer) {
      auto it = refs.find(s.blocks.back());
      if (--it->second == 0) refs.erase(it);
      s.blocks.pop_back();
    }
    while (static_cast<int64_t>(s.blocks.size()) < blocks_per_layer) {
      s.blocks.push_back(next_block_id_);
      refs[next_block_id_++] = 1;
    }
    attentions_[s.attention].kv_reserved_slots += kv - s.kv_slots;
    s.kv_slots = kv;
    s.state = State::kPrefilling;
    s.draft_length = demand.draft_length;
    s.last_used = ++tick_;
    ++attentions_[s.attention].running;
    admission.sequence_id = id;
    admission.indexer = s.indexer;
    admission.attention = s.attention;
    admission.continue_sequence = true;
    admission.continued_length = s.length;
    return admission;
  }

  // Per indexer worker: the donor sharing the longest run of leading prefix blocks.
  struct Candidate {
    int indexer;
    int64_t shared_slots;
    uint64_t donor;  // 0 = none
    double load;
  };
  std::vector<Candidate> candidates;
  for (int i = 0; i < static_cast<int>(indexer_info_.size()); ++i) {
    const int64_t capacity = indexer_info_[i].capacity_blocks;
    const double used = static_cast<double>(layers * indexers_[i].block_refs.size());
    candidates.push_back({i, 0, 0, capacity > 0 ? used / static_cast<double>(capacity) : 1.0});
  }
  if (!demand.prefix_block_ids.empty() && SharedPrefixSlots(1, demand.context_length) > 0) {
    for (const auto& [id, s] : sequences_) {
      // A finished sequence whose KV Release is in flight keeps its index keys when it is to be
      // retained, so it is a donor already.
      const bool eligible = s.state == State::kRetained ||
                            (s.state == State::kReleasing && s.retain_after_release) ||
                            (s.state == State::kRunning && s.draft_length == 0);
      // Only the caller's own donors: a shared prefix tells the caller (prefix_slots_reused) that
      // a donor held those blocks, i.e. what its sender sent.
      if (!eligible || s.caller != demand.caller) continue;
      size_t run = 0;
      while (run < s.whole_prefix_ids.size() && run < demand.prefix_block_ids.size() &&
             s.whole_prefix_ids[run] == demand.prefix_block_ids[run]) {
        ++run;
      }
      const int64_t shared = SharedPrefixSlots(static_cast<int64_t>(run), demand.context_length);
      Candidate& c = candidates[s.indexer];
      if (shared > c.shared_slots || (shared == c.shared_slots && shared > 0 && id < c.donor)) {
        c.shared_slots = shared;
        c.donor = id;
      }
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(b.shared_slots, a.load, a.indexer) <
           std::tie(a.shared_slots, b.load, b.indexer);
  });
  std::vector<int> attention_order(attention_info_.size());
  for (int j = 0; j < static_cast<int>(attention_order.size()); ++j) attention_order[j] = j;
  std::stable_sort(attention_order.begin(), attention_order.end(), [this](int a, int b) {
    return attentions_[a].running < attentions_[b].running;
  });

  for (const Candidate& c : candidates) {
    if (!indexers_[c.indexer].ready) continue;
    const int64_t shared_blocks = c.shared_slots / kBlockSize;
    for (int j : attention_order) {
      if (options_.colocated && j != c.indexer) continue;  // its indexer lives in worker j
      if (!attentions_[j].ready) continue;
      std::optional<std::vector<uint64_t>> plan =
          PlanEvictions(c.indexer, (blocks_per_layer - shared_blocks) * layers, j, kv, c.donor);
      if (!plan.has_value()) continue;
      for (uint64_t victim : *plan) admission.evictions.push_back(Evict(victim));
      uint64_t id = 0;
      if (options_.draw_sequence_id) {
        do {
          id = options_.draw_sequence_id();
        } while (id == 0 || sequences_.contains(id));
      } else {
        id = next_sequence_id_++;
      }
      Sequence s;
      s.indexer = c.indexer;
      s.attention = j;
      s.state = State::kPrefilling;
      s.draft_length = demand.draft_length;
      const int64_t whole = std::min<int64_t>(static_cast<int64_t>(demand.prefix_block_ids.size()),
                                              demand.context_length / kPrefixBlockTokens);
      s.whole_prefix_ids.assign(demand.prefix_block_ids.begin(),
                                demand.prefix_block_ids.begin() + whole);
      s.length = 0;
      auto& refs = indexers_[c.indexer].block_refs;
      if (c.donor != 0) {
        Sequence& donor = sequences_.at(c.donor);
        for (int64_t b = 0; b < shared_blocks; ++b) {
          s.blocks.push_back(donor.blocks[b]);
          ++refs[donor.blocks[b]];
        }
        ++donor.pins;
        donor.last_used = ++tick_;
        s.donor = c.donor;
        admission.prefix_source_id = c.donor;
        admission.prefix_slots = c.shared_slots;
      }
      while (static_cast<int64_t>(s.blocks.size()) < blocks_per_layer) {
        s.blocks.push_back(next_block_id_);
        refs[next_block_id_++] = 1;
      }
      s.kv_slots = kv;
      attentions_[j].kv_reserved_slots += kv;
      ++attentions_[j].running;
      s.session_key = SessionKey(demand);
      s.caller = demand.caller;
      s.last_used = ++tick_;
      if (!s.session_key.empty()) session_sequences_[s.session_key] = id;
      sequences_.emplace(id, std::move(s));
      admission.sequence_id = id;
      admission.indexer = c.indexer;
      admission.attention = j;
      return admission;
    }
  }
  return std::nullopt;
}

void Scheduler::Unpin(uint64_t donor, std::vector<Eviction>& evictions) {
  auto it = sequences_.find(donor);
  if (it == sequences_.end()) return;
  Sequence& s = it->second;
  if (--s.pins == 0 && s.release_when_unpinned && s.state == State::kRetained) {
    evictions.push_back(Evict(donor));
  }
}

std::vector<Eviction> Scheduler::PrefillDone(uint64_t sequence_id) {
  std::vector<Eviction> evictions;
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return evictions;
  it->second.state = State::kRunning;
  if (it->second.donor.has_value()) {
    const uint64_t donor = *it->second.donor;
    it->second.donor.reset();
    Unpin(donor, evictions);
  }
  return evictions;
}

Scheduler::FinishResult Scheduler::Finish(uint64_t sequence_id, bool completed, int64_t length,
                                          std::vector<int32_t> history) {
  FinishResult result;
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return result;
  Sequence& s = it->second;
  if (s.state == State::kReleasing) return result;
  if (s.state != State::kRetained) {
    --attentions_[s.attention].running;
    CountFinished(s.caller);
  }
  if (s.donor.has_value()) {
    const uint64_t donor = *s.donor;
    s.donor.reset();
    Unpin(donor, result.evictions);
  }
  if (!s.session_key.empty()) busy_sessions_.erase(s.session_key);
  s.last_used = ++tick_;
  // A worker that restarted (or left) while the sequence ran no longer holds its half: nothing of
  // it is kept, whatever its outcome (ForgetRetainedOn forgot its session already).
  const bool on_retired = indexers_[s.indexer].retired || attentions_[s.attention].retired;
  s.history.clear();
  if (completed && !on_retired && !s.session_key.empty()) {
    s.state = State::kRetained;
    s.length = length;
    s.history = std::move(history);
    result.release_attention = false;
    return result;
  }
  if ((!completed || on_retired) && !s.session_key.empty()) {
    auto session = session_sequences_.find(s.session_key);
    if (session != session_sequences_.end() && session->second == sequence_id) {
      session_sequences_.erase(session);
    }
    s.session_key.clear();
  }
  s.state = State::kReleasing;
  const bool kept_as_donor = completed && !on_retired && options_.retain_finished;
  s.retain_after_release = kept_as_donor || s.pins > 0;
  if (completed) s.length = length;
  s.release_when_unpinned = !kept_as_donor;
  result.keep_indexer_sequence = s.retain_after_release;
  return result;
}

std::vector<Eviction> Scheduler::ReleaseDone(uint64_t sequence_id) {
  std::vector<Eviction> evictions;
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end() || it->second.state != State::kReleasing) return evictions;
  Sequence& s = it->second;
  attentions_[s.attention].kv_reserved_slots -= s.kv_slots;
  s.kv_slots = 0;
  if (s.retain_after_release) {
    s.state = State::kRetained;
    // The prefill that pinned it may have ended while the Release was in flight.
    if (s.pins == 0 && s.release_when_unpinned) evictions.push_back(Evict(sequence_id));
    return evictions;
  }
  DropBlocks(s);
  sequences_.erase(it);
  return evictions;
}

SchedulerLoad Scheduler::Load() const {
  SchedulerLoad load;
  load.queued = static_cast<int>(queue_.size());
  for (const AttentionState& a : attentions_) load.running += a.running;
  load.indexers.resize(indexer_info_.size());
  for (size_t i = 0; i < indexer_info_.size(); ++i) {
    load.indexers[i].capacity_blocks = indexer_info_[i].capacity_blocks;
    load.indexers[i].used_blocks =
        options_.num_full_layers * static_cast<int64_t>(indexers_[i].block_refs.size());
  }
  for (const auto& [id, s] : sequences_) {
    if (s.state == State::kRetained) ++load.retained;
    ++load.indexers[s.indexer].sequences;
  }
  return load;
}

}  // namespace dsa
