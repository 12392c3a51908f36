// In-memory attention and indexer workers behind CoordinatorEngine's worker-client interfaces
// (coordinator/worker_clients.h), for the engine's deterministic tests and fuzz harness: each
// keeps its sequences' lengths, records the calls it answers, and fails on demand (down: every
// call UNAVAILABLE, as a killed or unreachable process; hung: DecodeStep DEADLINE_EXCEEDED; not
// ready; restarted: a new instance id with nothing held; stalled: a SIGSTOPped process whose
// Prefill and DecodeStep calls stay open until cancelled). No threads, no sleeps, no gRPC.
// An attention worker whose shape has a vocab_size runs the tiny real model (tiny_model.h): its
// Prefill takes the new slots' tokens and answers next_token, its DecodeStep takes the rows'
// tokens and answers sampled_tokens, and its KV holds the tokens of its slots, as the attention
// worker's contract says.
// DecodeStep fails a batch whole when a sequence is unknown (NOT_FOUND) or its indexer is down
// (UNAVAILABLE), advancing nothing, as the attention worker's contract says. An indexer without
// audits refuses a new sequence's miss target, and its attention worker's Prefill answers that
// refusal unchanged, as the real ones do.
// Leases: each worker keeps a real lease table (server/sequence_leases.h) on the clock it is given:
// a Prefill's lease holds the sequence on the attention worker and, for a new sequence, on its
// indexer; RenewLease renews it; a lease not renewed for its ttl by that clock has its sequences
// dropped at the worker's next call (the real sweep runs every 250 ms); a new instance of the same
// owner drops the earlier one's at once and refuses it from then on (FAILED_PRECONDITION).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/worker_clients.h"
#include "dsa/common/v1/lease.pb.h"
#include "server/sequence_leases.h"

namespace dsa::testing {

/// What a fake attention worker's GetInfo reports.
struct FakeAttentionShape {
  int num_full_layers = 2;
  int64_t num_heads = 4;
  int64_t head_dim = 16;
  int64_t kv_capacity_slots = 0;  // 0 = unlimited
  // The model GetInfo reports; vocab_size > 0: the tiny real model (tiny_model.h).
  std::string model = "pattern";
  int32_t vocab_size = 0;
  int32_t eos_token_id = -1;
  int64_t max_context = 0;
};

/// The tiny real model's shape: vocabulary kTinyVocab, end-of-sequence kTinyEos, `max_context`.
FakeAttentionShape TinyModelShape(int64_t max_context = 4096);

class FakeWorkers final : public WorkerClientFactory,
                          public std::enable_shared_from_this<FakeWorkers> {
 public:
  using AttentionShape = FakeAttentionShape;
  /// `clock` (not owned, outlives the fakes) times the workers' leases.
  explicit FakeWorkers(const Clock* clock = &RealClock()) : clock_(clock) {}
  /// Adds a worker at `address` (a host:port the engine is told); it answers at once.
  void AddAttention(const std::string& address, AttentionShape shape = {});
  void AddIndexer(const std::string& address, int64_t capacity_blocks = int64_t{1} << 20,
                  int64_t num_heads = 4, int64_t head_dim = 16);

  /// Down: every call of that worker answers UNAVAILABLE and its readiness fails (kill -9, a
  /// partition); up again: it answers with what it held (SIGCONT, a healed partition).
  void SetDown(const std::string& address, bool down);
  /// Hung: every call answers DEADLINE_EXCEEDED (SIGSTOP, seen through each call's deadline).
  void SetHung(const std::string& address, bool hung);
  /// Stalled (SIGSTOP, seen as the real client sees it): Prefill, DecodeStep and Commit calls
  /// wait, open, until the worker is let go (then they are answered) or the call's `cancelled`
  /// turns true (CANCELLED); the checks and Release answer DEADLINE_EXCEEDED at once (their short
  /// deadlines). A waiting call looks at `cancelled` every millisecond, as the gRPC client does
  /// every 20; after 20 s it gives up with DEADLINE_EXCEEDED (a broken test fails, not hangs).
  void SetStalled(const std::string& address, bool stalled);
  /// The attention worker at `address` answers its next DecodeStep, then stalls (a process
  /// stopped between a step and its Commits).
  void StallAfterNextStep(const std::string& address);
  /// Waits until `count` calls of the attention worker at `address` wait in its stall; false
  /// after `timeout`.
  bool AwaitStalledCalls(const std::string& address, int count, absl::Duration timeout);
  /// Calls of the attention worker at `address` that ended because they were cancelled while
  /// stalled.
  int CancelledCalls(const std::string& address);
  /// Its readiness answers NOT_SERVING (draining) while its calls still work.
  void SetNotReady(const std::string& address, bool not_ready);
  /// Its health check alone gets no answer in time (timed_out readiness); every other call
  /// answers. `indexer_only`: only the indexer at `address` (a co-located pair's indexer half).
  void SetHealthHung(const std::string& address, bool hung, bool indexer_only = false);
  /// The next `count` checks (GetInfo / GetLoad) of the worker(s) at `address` fail as a
  /// connection that failed to open (gRPC 1.51 can report a connect still in progress as failed):
  /// UNAVAILABLE, or DEADLINE_EXCEEDED for a call made with wait_for_ready (it waited out its
  /// deadline for a connection), as a down worker's checks answer too; the worker, set up or not
  /// yet, is otherwise unchanged.
  void FailConnects(const std::string& address, int count);
  /// The checks (GetInfo / GetLoad) of the worker(s) at `address` made with wait_for_ready.
  int ChecksWaitingForReady(const std::string& address);
  /// Held: the indexer's GetLoad calls wait (as a slow check does) until it is let go.
  void HoldGetLoads(const std::string& address, bool hold);
  /// Waits until `count` GetLoad calls of the indexer at `address` are held; false after
  /// `timeout` (a test's safety net).
  bool AwaitHeldGetLoads(const std::string& address, int count, absl::Duration timeout);
  /// A restart: a new instance id, and every sequence it held is gone.
  void Restart(const std::string& address);
  /// Marks the attention worker's sequence broken (its indexer advanced it in a step that failed
  /// on another sequence): every DecodeStep with it fails whole, FAILED_PRECONDITION, until it is
  /// released.
  void SetBroken(const std::string& address, uint64_t sequence_id);
  /// Unreachable from the attention workers: the indexer at `address` answers the coordinator's
  /// calls, but the attention workers' Prefills of new sequences on it answer UNAVAILABLE naming
  /// it, creating nothing (their connections to a restarted indexer still in backoff).
  void SetUnreachableFromAttention(const std::string& address, bool unreachable);
  /// Without audits (dsa-indexer --audit-fraction 0): the indexer at `address` refuses to create
  /// a sequence whose SPIN settings carry a miss target > 0 (FAILED_PRECONDITION, the real
  /// indexer's message), and the Prefill that asked for it answers that refusal, creating nothing.
  void SetWithoutAudits(const std::string& address, bool without_audits);

  /// Sequences held by the worker at `address` (0 for an unknown address).
  int Sequences(const std::string& address);
  /// Sequence ids of the Releases the worker at `address` answered OK, in order.
  std::vector<uint64_t> Released(const std::string& address);
  /// Release calls the worker(s) at `address` received (answered or not).
  int ReleaseCalls(const std::string& address);
  /// DecodeStep calls the worker at `address` received (answered or not).
  int DecodeSteps(const std::string& address);
  /// GetLoad calls the indexer worker at `address` received (answered or not).
  int GetLoads(const std::string& address);
  /// Prefill calls the attention worker at `address` received (answered or not).
  int PrefillCalls(const std::string& address);
  /// Prefills the worker at `address` answered OK, in order.
  std::vector<dsa::attention::v1::PrefillRequest> Prefills(const std::string& address);
  /// DecodeSteps the attention worker at `address` answered OK, in order.
  std::vector<dsa::attention::v1::DecodeStepRequest> Steps(const std::string& address);
  /// Commits the attention worker at `address` answered OK, in order.
  std::vector<dsa::attention::v1::CommitRequest> Commits(const std::string& address);
  /// While `failure` is not OK, RenewLease of the worker(s) at `address` answers it and renews
  /// nothing (a renewal lost on the way while the worker's other calls work).
  void FailRenewals(const std::string& address, const absl::Status& failure);
  /// The leases the worker(s) at `address` renewed (RenewLease answered OK), in order.
  std::vector<dsa::common::v1::Lease> Renewals(const std::string& address);
  /// RenewLease calls the worker(s) at `address` received (answered or not).
  int RenewLeaseCalls(const std::string& address);
  /// The tiny real model's KV of a sequence: the token ids of its slots (empty if unknown).
  std::vector<int32_t> KvTokens(const std::string& address, uint64_t sequence_id);

  std::shared_ptr<AttentionWorkerClient> Attention(const std::string& address) override;
  std::shared_ptr<IndexerWorkerClient> Indexer(const std::string& address) override;

 private:
  friend class FakeAttentionClient;
  friend class FakeIndexerClient;
  struct Sequence {
    int64_t length = 0;
    int pending_rows = 0;  // > 1 while a speculative step awaits its Commit
    bool broken = false;   // attention side: SetBroken
    std::string indexer;   // attention side: the indexer worker named in its Prefill
    // The tiny real model: the tokens of its `length` slots, the rows' tokens of the step that
    // awaits its Commit, and how it samples.
    std::vector<int32_t> kv;
    std::vector<int32_t> pending_tokens;
    dsa::attention::v1::SamplingParams sampling;
  };
  struct Worker {
    bool attention = false;
    AttentionShape shape;
    int64_t capacity_blocks = 0;
    bool down = false;
    bool hung = false;
    bool not_ready = false;
    bool health_hung = false;
    bool stalled = false;
    bool stall_after_step = false;
    bool without_audits = false;          // indexer: refuses miss targets (SetWithoutAudits)
    bool attention_cannot_reach = false;  // indexer: SetUnreachableFromAttention
    int stalled_calls = 0;                // waiting in the stall now
    int cancelled_calls = 0;              // ended by their cancellation while stalled
    int instance = 1;
    std::map<uint64_t, Sequence> sequences;
    std::vector<uint64_t> released;
    std::vector<dsa::attention::v1::PrefillRequest> prefills;
    std::vector<dsa::attention::v1::DecodeStepRequest> steps;
    std::vector<dsa::attention::v1::CommitRequest> commits;
    int prefill_calls = 0;
    int decode_steps = 0;
    int release_calls = 0;
    int get_loads = 0;
    bool hold_get_loads = false;
    int held_get_loads = 0;
    std::unique_ptr<SequenceLeases> leases;  // a fresh table per instance
    std::vector<dsa::common::v1::Lease> renewals;
    int renew_lease_calls = 0;
    absl::Status renewal_failure;  // FailRenewals
  };
  // The worker at `address` of a kind, or null (an address no fake listens on); first drops the
  // sequences of its leases that expired by the clock (the worker's sweep).
  Worker* Find(const std::string& address, bool attention) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status Gone(const Worker* w, const std::string& address);
  // What a check (GetInfo / GetLoad) of the worker `w` at `address` meets before the worker: a
  // connect failure FailConnects left, or, made with wait_for_ready, DEADLINE_EXCEEDED for a
  // worker that is down or absent (the real client waits out its deadline); else OK. Counts the
  // checks made with wait_for_ready.
  absl::Status ConnectLocked(const Worker* w, const std::string& address, const WorkerCall& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropLocked(Worker* w, const std::vector<uint64_t>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RenewLocked(const std::string& address, bool attention,
                           const dsa::common::v1::Lease& lease, dsa::common::v1::LeaseState* state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Holds a Prefill or DecodeStep of the attention worker at `address` while it is stalled
  // (SetStalled); OK once let go (look `w` up again: mu_ was released), CANCELLED when the call
  // was cancelled.
  absl::Status WaitWhileStalled(const std::string& address, const WorkerCall& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  absl::Mutex mu_;
  absl::CondVar stall_changed_;  // a worker let go
  std::map<std::string, Worker> attention_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Worker> indexers_ ABSL_GUARDED_BY(mu_);
  // By address, whether a worker is there yet or not (FailConnects).
  std::map<std::string, int> connect_failures_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> checks_waiting_for_ready_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dsa::testing
