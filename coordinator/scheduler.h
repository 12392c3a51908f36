// The coordinator's admission and placement logic without gRPC (docs/services.md "Coordinator"):
// index-key-cache accounting per indexer worker, KV and running-slot accounting per attention
// worker, the bounded queue with per-caller limits and weighted fair queuing between callers,
// prefix-aware placement (a caller's own donors only), retained donors and multi-turn sessions with
// least-recently-used eviction.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "contracts/layout.h"

namespace dsa {

/// Slots a request of `context_length` tokens shares with a donor whose prompt holds its first
/// `matching_prefix_blocks` prefix blocks whole: 512 a block, capped at the context rounded down
/// to a 64-slot cache block (sharing is by whole cache blocks). Both >= 0.
inline int64_t SharedPrefixSlots(int64_t matching_prefix_blocks, int64_t context_length) {
  const int64_t whole_cache_blocks = context_length / kBlockSize * kBlockSize;
  return matching_prefix_blocks * kPrefixBlockTokens < whole_cache_blocks
             ? matching_prefix_blocks * kPrefixBlockTokens
             : whole_cache_blocks;
}

/// Deployment-wide settings of the scheduler.
struct SchedulerOptions {
  int num_full_layers = 1;             // indexer layers per sequence (attention GetInfo), >= 1
  int max_queue = 64;                  // queued requests at most; a full queue refuses at once
  int max_running_per_attention = 32;  // running (prefilling or decoding) sequences per worker
  /// Queued requests of one caller at most (a caller at it is refused at once, so that one
  /// caller cannot fill the queue alone). 0 = no limit of its own (max_queue only); -1 = a
  /// quarter of max_queue, at least 1.
  int max_queued_per_caller = 0;
  /// Running (prefilling or decoding) requests of one caller at most: its further requests wait
  /// in the queue, which serves other callers meanwhile, so that one caller (say one whose
  /// streams read slowly and hold their slots for their whole max_new_tokens) cannot hold every
  /// running slot. 0 = no limit; -1 = the ready attention workers' running slots less a quarter
  /// of them (at least one slot left to others where there are two or more).
  int max_running_per_caller = 0;
  /// Weight of each caller in the fair queuing between callers (absent: 1): while callers wait
  /// with queued requests, one of weight 2 is admitted twice as often as one of weight 1. >= 1.
  absl::flat_hash_map<std::string, int> caller_weights;
  bool retain_finished = true;     // keep finished sequences' index keys as prefix donors
  uint64_t first_sequence_id = 1;  // sequence ids are handed out from here upwards
  /// When set, each new sequence's id is drawn from it instead (a draw of 0, or of an id the
  /// scheduler still holds, is drawn again): the coordinator draws them at random, so that a
  /// caller who sees one id cannot claim the next ones on a worker first.
  std::function<uint64_t()> draw_sequence_id;
  /// Co-located workers (dsa-attention --transport inprocess): indexer worker i lives in attention
  /// worker i's process, so a sequence placed on indexer i runs on attention worker i (and the
  /// counts must be equal).
  bool colocated = false;
};

/// One indexer worker as the scheduler sees it.
struct IndexerWorkerInfo {
  std::string address;
  int64_t capacity_blocks = 0;  // 64-slot blocks over all layers (indexer GetLoad)
};

/// One attention worker as the scheduler sees it.
struct AttentionWorkerInfo {
  std::string address;
  int64_t kv_capacity_slots = 0;  // KV slots over its sequences; <= 0 = unlimited
};

/// Parses caller weights given as "NAME=W" (dsa-coordinator --caller-weight; the name is what
/// TenantIdentity says: a token's client, a certificate's name, or "peer:HOST"; split at the last
/// '='). INVALID_ARGUMENT (naming the entry) for a missing '=' or name, a weight that is not an
/// integer in [1, 1000000], or a name given twice.
absl::StatusOr<absl::flat_hash_map<std::string, int>> ParseCallerWeights(
    absl::Span<const std::string> entries);

/// What a request needs (validated by the caller: context_length >= 1, max_new_tokens >= 1,
/// draft_length 0..4, at most ceil(context_length / 512) prefix ids).
struct SequenceDemand {
  int64_t context_length = 1;  // tokens (slots) of the prompt
  int64_t max_new_tokens = 1;
  int draft_length = 0;                    // d
  std::vector<uint64_t> prefix_block_ids;  // one per 512 tokens
  std::string session_id;                  // empty = a one-off request
  /// The caller (TenantIdentity of its Generate call: a token or certificate name, else its
  /// peer's host). Sessions are scoped per caller, so two callers' sessions of the same id are two
  /// sessions, and no caller can continue (or block with a queued turn) another caller's session;
  /// a request shares a prefix only with a donor of the same caller (what another sent is not
  /// its to learn from prefix_slots_reused); the per-caller limits and the fair queuing count
  /// requests by it.
  std::string caller;
};

/// The key of `demand`'s session in the scheduler: (caller, session_id), unambiguous
/// (length-prefixed caller); empty when it names no session.
std::string SessionKey(const SequenceDemand& demand);

/// A retained sequence to drop on the workers (the scheduler has already forgotten it).
struct Eviction {
  uint64_t sequence_id = 0;
  int indexer = 0;    // index into the indexer workers
  int attention = 0;  // index into the attention workers
  /// True for a session whose KV is still on the attention worker: release it there (without
  /// keep_indexer_sequence, which drops the indexer sequence too). False for a donor whose KV is
  /// gone: release its indexer sequence directly.
  bool release_on_attention = false;
  /// A retired worker's retained sequence: release it on the attention worker (which drops its
  /// indexer sequence too) and on the indexer worker, each best effort. The surviving worker
  /// holds its half, and a restarted worker's new process may hold what was placed there before
  /// the restart was seen.
  bool release_on_both = false;
};

/// A placed request: what the coordinator sends in Prefill.
struct Admission {
  uint64_t ticket = 0;       // the caller's id of the request
  uint64_t sequence_id = 0;  // new, or the session's sequence when continue_sequence
  int indexer = 0;
  int attention = 0;
  std::optional<uint64_t> prefix_source_id;  // a donor on the same indexer worker
  int64_t prefix_slots = 0;                  // multiple of 64, <= context_length
  bool continue_sequence = false;            // extend the session's sequence (new turn)
  /// continue_sequence: the session's length after its last turn (that turn's context +
  /// generated tokens; with a real model the attention worker's KV holds one slot less, the last
  /// generated token being the next input).
  int64_t continued_length = 0;
  std::vector<Eviction> evictions;  // to carry out before the Prefill
};

/// The index-key cache of one indexer worker by the scheduler's reservations.
struct IndexerLoad {
  int64_t used_blocks = 0;  // reserved (sequences' whole demand, shared blocks counted once)
  int64_t capacity_blocks = 0;
  int sequences = 0;  // running and retained sequences placed there
};

/// Counts for GetLoad.
struct SchedulerLoad {
  int queued = 0;
  int running = 0;   // prefilling or decoding
  int retained = 0;  // finished donors and idle sessions
  std::vector<IndexerLoad> indexers;
};

/// Admission and placement (docs/services.md "Coordinator"). Queued requests are admitted by
/// weighted fair queuing between callers (start-time fair queuing: each request gets a virtual
/// start tag, max(the virtual time, its caller's last finish tag), and a finish tag 1 / weight
/// later; the queued request with the least start tag among callers below their running limit is
/// admitted next, ties in arrival order), so a caller that queued many requests does not delay
/// another's request behind all of them; a caller's own requests keep their order. A request
/// needs
/// `full_layers * ceil((context + max_new_tokens + d) / 64)` index-key-cache blocks on its indexer
/// worker, less the blocks it shares with its prefix donor (blocks are reference counted, so a
/// block shared by several sequences is counted once and freed with its last holder), and
/// `context + max_new_tokens + d` KV slots on its attention worker. Placement: the indexer worker
/// holding the longest run of the request's leading prefix block ids (among retained donors, also
/// while their KV release is in flight, idle sessions and running sequences without speculative
/// steps whose prefill completed; only whole 512-slot blocks of the donor's prompt), ties and
/// misses to the least-loaded (used / capacity); the attention worker with the fewest running
/// sequences below max_running and with KV room. Room is made by evicting retained sequences that
/// are not pinned (a donor of a prefill in progress), least recently used first. Not thread-safe:
/// the caller serializes every call.
class Scheduler {
 public:
  /// Starts with `indexers` and `attentions` (either may be empty: AddIndexer and AddAttention add
  /// workers later), all ready. INVALID_ARGUMENT when num_full_layers < 1, max_queue < 0,
  /// max_running_per_attention < 1, a per-caller limit < -1, a caller weight < 1, a capacity is
  /// negative, or co-located lists differ.
  static absl::StatusOr<Scheduler> Create(const SchedulerOptions& options,
                                          std::vector<IndexerWorkerInfo> indexers,
                                          std::vector<AttentionWorkerInfo> attentions);

  /// Adds a worker, ready; returns its index (the next one: indices never change or get reused).
  /// Co-located (SchedulerOptions::colocated): add indexer worker i, then attention worker i at
  /// the same address, else FAILED_PRECONDITION / INVALID_ARGUMENT. INVALID_ARGUMENT for a
  /// negative capacity.
  absl::StatusOr<int> AddIndexer(IndexerWorkerInfo info);
  absl::StatusOr<int> AddAttention(AttentionWorkerInfo info);
  /// Whether new sequences may be placed on a worker. What it holds stays; a session whose
  /// sequence is on a worker that is not ready starts its next turn afresh on ready workers (the
  /// old sequence is dropped, best effort). OUT_OF_RANGE for an unknown index,
  /// FAILED_PRECONDITION to make a retired worker ready.
  absl::Status SetIndexerReady(int indexer, bool ready);
  absl::Status SetAttentionReady(int attention, bool ready);
  /// A worker that restarted or is gone for good: never placed on again, and its retained
  /// sequences (prefix donors, idle sessions) are forgotten at once (a donor that a prefill in
  /// progress uses goes when that prefill ends); returns their releases (release_on_both), for
  /// the other worker of each holds its half. Its running sequences stay until Finish.
  /// OUT_OF_RANGE for an unknown index.
  absl::StatusOr<std::vector<Eviction>> RetireIndexer(int indexer);
  absl::StatusOr<std::vector<Eviction>> RetireAttention(int attention);
  /// Removes and returns (in queue order) the queued tickets that no ready worker could hold even
  /// when empty (or all of them when no worker of a kind is ready): the caller fails them, so a
  /// worker that left cannot keep requests queued forever.
  std::vector<uint64_t> TakeUnplaceableQueued();
  /// Sets the full layers of every sequence (the attention workers' GetInfo, known once the first
  /// one answers). FAILED_PRECONDITION while a sequence is held or queued; INVALID_ARGUMENT < 1.
  absl::Status SetNumFullLayers(int num_full_layers);
  /// Whether nothing is held (no sequence: running, releasing or retained) and nothing queued:
  /// only then may the model behind the workers change (CoordinatorEngine).
  bool Idle() const { return sequences_.empty() && queue_.empty(); }
  /// Workers of each kind that are ready.
  int ReadyIndexers() const;
  int ReadyAttentions() const;

  /// Blocks (over all layers) that `demand` reserves without sharing.
  int64_t BlocksNeeded(const SequenceDemand& demand) const;

  /// Admits `ticket` at once when it would be the next admitted (no queued request of a caller
  /// below its running limit comes before it in the fair order), its caller is below its running
  /// limit and it fits (returns the admission), else queues it (returns nullopt; AdmitQueued places
  /// it later). Errors, with nothing changed: RESOURCE_EXHAUSTED when it is larger than any
  /// worker's whole capacity (the message gives the blocks or slots needed and the largest
  /// capacity), a session's turn is larger than its own workers' capacity, the queue is full, or
  /// its caller has max_queued_per_caller requests queued (the message names the caller and its
  /// limit, nothing of other callers); FAILED_PRECONDITION
  /// when its session has a turn queued or running; INVALID_ARGUMENT when its session's sequence
  /// is longer than the new context (previous context + generated tokens), or, when the session
  /// kept its token history (Finish's `history`: a real model), when `context_tokens` does not
  /// start with that history (the message names the first position that differs).
  /// `migrated`: the request is moving off a worker that failed (its context now includes the
  /// tokens it generated): it is placed ahead of every queued request and, when it must wait,
  /// queued at the head even when the queue (or its caller's share) is full; the per-caller
  /// running limit does not hold it back (it was admitted already). `context_tokens`: the request's
  /// token ids (a real model's), only read here.
  absl::StatusOr<std::optional<Admission>> Submit(uint64_t ticket, const SequenceDemand& demand,
                                                  bool migrated = false,
                                                  absl::Span<const int32_t> context_tokens = {});

  /// Places queued requests in the fair order (migrated ones first, then by start tag, skipping
  /// callers at their running limit) while the next one fits; call after anything freed room.
  std::vector<Admission> AdmitQueued();

  /// Removes a queued ticket; false if it is not queued.
  bool CancelQueued(uint64_t ticket);
  /// Removes every queued ticket and returns them in queue order (drain).
  std::vector<uint64_t> CancelAllQueued();

  /// The sequence's prefill completed: it becomes a prefix donor (without speculative steps) and
  /// its own donor is unpinned. Returns evictions to carry out (a donor kept only for this
  /// prefill, now released).
  std::vector<Eviction> PrefillDone(uint64_t sequence_id);

  /// How a finished or failed sequence leaves its attention worker.
  struct FinishResult {
    /// False: a session keeps its KV and index keys (no Release at all). True: call the attention
    /// worker's Release, then ReleaseDone.
    bool release_attention = true;
    bool keep_indexer_sequence = false;  // Release with keep_indexer_sequence
    std::vector<Eviction> evictions;     // others to drop now
  };
  /// A running (or prefilling) sequence ends; its running slot is free at once. `completed` with
  /// `length` (its slots: context + generated): a session's sequence stays whole (KV and index
  /// keys), other sequences keep their index keys as donors when retain_finished (or while a
  /// prefill uses them as a donor), else everything is freed. Not completed (failed, aborted):
  /// freed, and a session loses its sequence (its next turn starts afresh), unless a prefill in
  /// progress uses it as a donor. A sequence whose indexer or attention worker was retired while
  /// it ran is freed whatever its outcome (the restarted process lost its half; found by
  /// fuzz_coordinator_service). What the attention worker's Release frees (KV, index keys) stays
  /// reserved until ReleaseDone, so no request is placed into space the workers still hold.
  /// `history`: the sequence's token ids (context + generated; `length` of them) when a real
  /// model made them, kept with a session's sequence for its next turn's check (Submit), else
  /// dropped.
  FinishResult Finish(uint64_t sequence_id, bool completed, int64_t length,
                      std::vector<int32_t> history = {});
  /// The attention worker's Release of a finished sequence returned (either way): frees what
  /// Finish said it would. Returns evictions to carry out (a donor kept only for a prefill that
  /// has ended meanwhile). No-op for a sequence not waiting for it.
  std::vector<Eviction> ReleaseDone(uint64_t sequence_id);

  /// Current counts and reservations.
  SchedulerLoad Load() const;
  const std::vector<IndexerWorkerInfo>& indexers() const { return indexer_info_; }
  const std::vector<AttentionWorkerInfo>& attentions() const { return attention_info_; }

 private:
  // kReleasing: finished, waiting for ReleaseDone (holds its reservations; neither a donor nor
  // evictable).
  enum class State { kPrefilling, kRunning, kReleasing, kRetained };
  struct Sequence {
    int indexer = 0;
    int attention = 0;
    State state = State::kPrefilling;
    int draft_length = 0;
    std::vector<uint64_t> whole_prefix_ids;  // prefix ids of whole 512-slot prompt blocks
    int64_t length = 0;                      // slots after the last completed turn
    std::vector<int32_t> history;            // a real model's session: its `length` token ids
    std::vector<uint64_t> blocks;            // reserved block ids, one per 64 slots
    int64_t kv_slots = 0;                    // reserved KV slots on the attention worker
    std::string session_key;                 // SessionKey of its session; empty = not a session's
    std::string caller;                      // SequenceDemand::caller: only its requests share it
    int pins = 0;                            // prefills in progress that share its prefix
    std::optional<uint64_t> donor;           // pinned while this sequence prefills
    bool release_when_unpinned = false;
    bool retain_after_release = false;  // kReleasing: becomes kRetained, else dropped
    uint64_t last_used = 0;             // LRU tick
  };
  struct Pending {
    uint64_t ticket;
    SequenceDemand demand;
    bool migrated = false;   // admitted before: ahead of the fair order, no running limit
    double start_tag = 0.0;  // virtual start tag (class comment)
    uint64_t arrival = 0;    // ties between equal start tags
  };
  // A caller's share: its queued and running requests and its last virtual finish tag.
  struct CallerState {
    int queued = 0;
    int running = 0;
    double last_finish = 0.0;
  };
  struct IndexerState {
    absl::flat_hash_map<uint64_t, int> block_refs;  // block id -> holders
    bool ready = true;                              // placed on
    bool retired = false;                           // never ready again
  };
  struct AttentionState {
    int64_t kv_reserved_slots = 0;
    int running = 0;
    bool ready = true;     // placed on
    bool retired = false;  // never ready again
  };

  Scheduler(SchedulerOptions options, std::vector<IndexerWorkerInfo> indexers,
            std::vector<AttentionWorkerInfo> attentions);

  int64_t BlocksPerLayer(const SequenceDemand& demand) const;
  int64_t KvSlots(const SequenceDemand& demand) const;
  int64_t FreeBlocks(int indexer) const;
  int64_t FreeKv(int attention) const;
  // Tries to place; on success commits the reservations and returns the admission.
  std::optional<Admission> TryPlace(uint64_t ticket, const SequenceDemand& demand);
  // Chooses LRU-first evictions so that `blocks` more blocks fit on `indexer` and `kv` more slots
  // and one more running sequence fit on `attention`; nullopt if impossible. Changes nothing.
  std::optional<std::vector<uint64_t>> PlanEvictions(int indexer, int64_t blocks, int attention,
                                                     int64_t kv, uint64_t protect) const;
  // Forgets a sequence's reservations; returns how to drop it on the workers.
  Eviction Evict(uint64_t sequence_id);
  // Forgets the retained sequences on a retired worker (`indexer` or `attention` >= 0).
  std::vector<Eviction> ForgetRetainedOn(int indexer, int attention);
  // Whether `demand` fits some ready worker of each kind when it is empty.
  bool FitsAReadyWorker(const SequenceDemand& demand) const;
  // The per-caller limits in force (max_*_per_caller resolved; 0 = none).
  int QueuedLimitPerCaller() const;
  int RunningLimitPerCaller() const;
  // Whether `caller` may have one more running request.
  bool BelowRunningLimit(const std::string& caller) const;
  // The queued request to admit next (fair order), or queue_.end() when none may be.
  std::deque<Pending>::iterator NextEligible();
  // Gives `pending` its start tag and advances its caller's finish tag.
  void TagArrival(Pending& pending);
  // Counts an admission of `caller`: the virtual time moves to `start_tag`.
  void CountAdmitted(const std::string& caller, double start_tag);
  // Counts a running request of `caller` that ended; forgets idle callers.
  void CountFinished(const std::string& caller);
  // Removes a queued request (its caller's count, its session's busy mark).
  std::deque<Pending>::iterator EraseQueued(std::deque<Pending>::iterator it);
  // Forgets `caller` when it has nothing queued or running and its tags are behind.
  void ForgetIdleCaller(const std::string& caller);
  void DropBlocks(Sequence& sequence);
  // Unpins `donor`; appends its eviction when it was kept only for the pin.
  void Unpin(uint64_t donor, std::vector<Eviction>& evictions);

  SchedulerOptions options_;
  std::vector<IndexerWorkerInfo> indexer_info_;
  std::vector<AttentionWorkerInfo> attention_info_;
  std::vector<IndexerState> indexers_;
  std::vector<AttentionState> attentions_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  // SessionKey -> its sequence (absent: none kept); busy sessions have a turn queued or running.
  absl::flat_hash_map<std::string, uint64_t> session_sequences_;
  absl::flat_hash_set<std::string> busy_sessions_;
  std::deque<Pending> queue_;
  absl::flat_hash_map<std::string, CallerState> callers_;
  double virtual_time_ = 0.0;  // start tag of the last admitted request
  uint64_t arrivals_ = 0;
  uint64_t next_sequence_id_;
  uint64_t next_block_id_ = 1;
  uint64_t tick_ = 0;
};

}  // namespace dsa
