// The coordinator's decode loops: continuous batching, one loop per attention worker, each
// iteration one DecodeStep over every running sequence of that worker with its speculative rows
// (seeded acceptance for the pattern model; n-gram drafts verified by a real model), Commits,
// per-sequence retries, and the Tokens and Finished events (docs/coordinator.md, "A request's
// life" 5 and "Real tokens"). Sequences come from the request lifecycle above, which gets back
// those that end or fail.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/engine_core.h"
#include "coordinator/generate.h"
#include "coordinator/request.h"
#include "coordinator/worker_pool.h"
#include "dsa/attention/v1/attention.pb.h"

namespace dsa {

/// The decode loops of the attention workers of a WorkerPool, one per worker slot. Thread-safe.
///
/// The pattern model (InFlightRequest::real false): rows = min(d + 1, tokens left); the accepted
/// count a of a speculative step is drawn from AcceptanceModel (seed mixed with the request id,
/// step = the request's verification count), Commit(a), and a Tokens event with count = a + 1; at
/// max_new_tokens it queues Finished (FinishReason::kLength).
/// A real model: a step's rows are 1 + the drafts ProposeNgramDraft finds in the sequence's tokens
/// (at most d, and at most tokens left - 1), with tokens = [the last token, drafts...]; a = the
/// leading drafts equal to the worker's sampled_tokens, and the step emits drafts[0, a) +
/// sampled_tokens[a], cut after the first end-of-sequence token (unless ignore_eos) or stop token
/// and at max_new_tokens; Commit(kept - 1) for a speculative step, so the worker's KV holds the
/// sequence's tokens but the last (the next step's input).
///
/// Backpressure: a sequence whose event queue holds more than max_pending_events - 2 events is
/// left out of its worker's DecodeStep until its reader catches up; one left out for
/// stall_timeout_ms is ended (CANCELLED, saying why).
///
/// Failures: a DecodeStep error is retried once per sequence alone, so the sequences the attention
/// worker left intact (it rolls back every sequence the indexer did not apply) go on, unless the
/// worker hung (DEADLINE_EXCEEDED, or cut by HungCut): then retrying one by one would only
/// multiply the wait. A sequence that still fails, or whose Commit fails, goes to the `fail` hook.
class DecodeLoops {
 public:
  /// What the loops hand back to the request lifecycle above them. Set once (SetHooks) before the
  /// first sequence decodes. Called unlocked, from a decode loop (or StepWorker's caller).
  struct Hooks {
    /// Ends an admitted request with `status` (`completed`: it generated all it was to) and takes
    /// its sequence off its workers (RequestLifecycle::EndSequence).
    std::function<void(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status,
                       bool completed)>
        end;
    /// A request's sequence failed with `status` (RequestLifecycle::FailSequence: it migrates or
    /// ends).
    std::function<void(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status)>
        fail;
  };

  /// What one decode step (or a real model's prefill) produced for a sequence.
  struct Produced {
    int64_t first_position = 0;      // of the first token
    int count = 0;                   // tokens emitted
    int drafted = 0;                 // rows - 1
    int accepted = 0;                // drafts kept (pattern) / confirmed by the model (real)
    std::vector<int32_t> token_ids;  // a real model's `count` ids
    // Set when these tokens end the request: max_new_tokens reached, or a real model's
    // end-of-sequence or stop token (`stop_token`).
    FinishReason finish = FinishReason::kUnspecified;
    std::optional<int32_t> stop_token;
    double seconds = 0;  // the step's (or the prefill's)
  };

  /// `core` and `pool` outlive the loops.
  DecodeLoops(EngineCore* core, WorkerPool* pool);
  DecodeLoops(const DecodeLoops&) = delete;
  DecodeLoops& operator=(const DecodeLoops&) = delete;

  /// Sets the hooks (see Hooks).
  void SetHooks(Hooks hooks);

  /// The pool took in attention worker `slot` (its `attention_added` hook): makes its loop's slot
  /// and, with run_loops, starts its thread.
  void AddWorkerLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Hands `request` (prefilled) to the loop of attention worker `worker`.
  void StartDecodingLocked(int worker, std::shared_ptr<InFlightRequest> request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Takes `request` out of worker `worker`'s loop (nothing if it is not there).
  void RemoveLocked(int worker, const std::shared_ptr<InFlightRequest>& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Wakes worker `worker`'s loop: a request was cancelled, or its reader made room in its queue.
  void WakeLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Sequences in worker `worker`'s loop.
  int DecodingLocked(int worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// With the core stopping: wakes the loops of slots [0, num_attention) so that they return.
  void WakeAllLocked(int num_attention) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Joins the loop threads of slots [0, num_attention) (after WakeAllLocked).
  void Join(int num_attention);

  /// Without run_loops: one iteration of the decode loop of the attention worker at `address`
  /// (ends its cancelled and stalled requests, then one DecodeStep over the rest with its Commits,
  /// retries and failures). Returns the sequences it stepped or ended (0: nothing to do).
  /// NOT_FOUND for an address not taken in; FAILED_PRECONDITION with run_loops.
  absl::StatusOr<int> StepWorker(const std::string& address);

  /// Waits until the attention worker at `address` has at least `count` sequences decoding (their
  /// prefills done); false after `timeout` (a test's safety net, not a pacing).
  bool AwaitDecoding(const std::string& address, int count, absl::Duration timeout);

  /// A real model's first token from its prefill (PrefillResponse.next_token), cut as a step's
  /// tokens are (CutEmission), or INTERNAL when the worker answered none or one outside the
  /// vocabulary. The handler's data of `request` only (before it decodes).
  absl::StatusOr<Produced> FirstToken(const InFlightRequest& request,
                                      const dsa::attention::v1::PrefillResponse& prefilled) const;

  /// Applies `produced` to its sequence: tokens, metrics, the Tokens event (with the step's
  /// `result` and `response` figures, each may be null), and Finished when it ends the request.
  /// Returns whether it ended it (the caller ends the sequence: the `end` hook).
  bool AdvanceSequence(const std::shared_ptr<InFlightRequest>& request, const Produced& produced,
                       const dsa::attention::v1::SequenceStepResult* result,
                       const dsa::attention::v1::DecodeStepResponse* response);

 private:
  // The decode loop of one attention worker (the slot of its WorkerPool::AttentionWorker).
  struct Slot {
    std::vector<std::shared_ptr<InFlightRequest>> decoding;  // guarded by the core's mu
    absl::CondVar wake;  // new work, room in an event queue, stop
    std::thread loop;
  };
  // What one decode-loop iteration works on: the sequences to step (rows each) and to end.
  struct Iteration {
    std::vector<std::shared_ptr<InFlightRequest>> batch;
    std::vector<int> rows;
    std::vector<std::shared_ptr<InFlightRequest>> cancelled;
    bool stalled = false;  // a sequence waits for its reader (look again when time has passed)
  };
  // One DecodeStep over `batch` (rows per request); the results per request, or the step's status.
  struct StepOutcome {
    absl::Status status;
    // The worker hung: the step ran into its deadline, or was cancelled because the worker's
    // checks stopped reaching it (hung_worker_checks). Its batch is not retried one by one.
    bool hung = false;
    dsa::attention::v1::DecodeStepResponse response;
    double seconds = 0;
  };

  // The decode loop of attention worker `worker`.
  void DecodeLoop(int worker);
  // Collects worker `worker`'s iteration, ending the requests whose readers have stalled past
  // the stall timeout (by the clock).
  Iteration CollectLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Runs a collected iteration: ends the cancelled, steps the batch (retries, failures).
  void RunIteration(int worker, const Iteration& iteration);
  StepOutcome RunStep(int worker, const std::vector<std::shared_ptr<InFlightRequest>>& batch,
                      const std::vector<int>& rows);
  // Applies a successful step to its batch: draws the accepted counts of speculative sequences
  // and commits them concurrently, then advances each sequence (a failed Commit fails its
  // sequence).
  void ApplyStep(int worker, const std::vector<std::shared_ptr<InFlightRequest>>& batch,
                 const std::vector<int>& rows, const StepOutcome& outcome);
  // A real model's emission: `candidates` (accepted drafts, then the model's token) cut after
  // the first end-of-sequence or stop token and at the request's max_new_tokens. Decode-loop (or
  // the handler's, before decoding) data of `request` only.
  Produced CutEmission(const InFlightRequest& request,
                       const std::vector<int32_t>& candidates) const;
  // Before a step: a real model's drafts (InFlightRequest::drafts) and rows for each request of
  // `batch`.
  void PlanDrafts(const std::vector<std::shared_ptr<InFlightRequest>>& batch,
                  std::vector<int>* rows);

  EngineCore* const core_;  // not owned
  WorkerPool* const pool_;  // not owned
  Hooks hooks_;             // set before the first sequence decodes, then read-only
  // By attention worker slot (WorkerPool::kMaxWorkersPerKind), set when the pool takes the worker
  // in; [0, the pool's attention count) are set.
  std::vector<std::unique_ptr<Slot>> slots_;
  absl::CondVar decoding_changed_;  // a sequence started decoding (AwaitDecoding)
};

}  // namespace dsa
