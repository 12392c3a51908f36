// A test double of dsa.attention.v1.AttentionService for the coordinator's tests: it keeps each
// sequence's length and pending speculative step in memory, creates, fills (zero index keys),
// continues and releases the sequences on the real indexer worker named in Prefill (so cache use
// and prefix sharing are the indexer's own), records every call, and fails or slows on demand.
// With a vocab_size it runs the tiny real model (tiny_model.h): Prefill takes the new slots'
// tokens and answers next_token, DecodeStep takes the rows' tokens and answers sampled_tokens,
// and the KV holds the tokens of the sequence's slots. Leases as the real worker's: a Prefill's
// lease holds the sequence here (a real lease table on the real clock) and goes with a new
// sequence to the indexer; RenewLease renews it; what an expired or superseded lease held is
// dropped here at the next Prefill or RenewLease (the indexer releases its own).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/sequence_leases.h"

namespace dsa::testing {

class FakeAttentionService final : public dsa::attention::v1::AttentionService::Service {
 public:
  struct Shape {
    int num_full_layers = 2;
    int num_heads = 4;
    int head_dim = 16;
    int64_t kv_capacity_slots = 0;  // 0 = unlimited
    // The model GetInfo reports; vocab_size > 0: the tiny real model.
    std::string model = "pattern";
    int32_t vocab_size = 0;
    int32_t eos_token_id = -1;
    int64_t max_context = 0;
  };
  explicit FakeAttentionService(Shape shape) : shape_(std::move(shape)) {}

  grpc::Status GetInfo(grpc::ServerContext* context,
                       const dsa::attention::v1::GetInfoRequest* request,
                       dsa::attention::v1::GetInfoResponse* response) override;
  grpc::Status Prefill(grpc::ServerContext* context,
                       const dsa::attention::v1::PrefillRequest* request,
                       dsa::attention::v1::PrefillResponse* response) override;
  grpc::Status DecodeStep(grpc::ServerContext* context,
                          const dsa::attention::v1::DecodeStepRequest* request,
                          dsa::attention::v1::DecodeStepResponse* response) override;
  grpc::Status Commit(grpc::ServerContext* context,
                      const dsa::attention::v1::CommitRequest* request,
                      dsa::attention::v1::CommitResponse* response) override;
  grpc::Status Release(grpc::ServerContext* context,
                       const dsa::attention::v1::ReleaseRequest* request,
                       dsa::attention::v1::ReleaseResponse* response) override;
  grpc::Status RenewLease(grpc::ServerContext* context,
                          const dsa::attention::v1::RenewLeaseRequest* request,
                          dsa::attention::v1::RenewLeaseResponse* response) override;

  /// Sequences prefilled with this context length fail every DecodeStep they are in with
  /// UNAVAILABLE "injected failure" (the batch fails and nothing advances, as the contract says).
  void FailDecodeOfContext(int64_t context_length);
  /// Every DecodeStep sleeps this long first (a worker's step time).
  void SetStepDelayMs(int delay_ms);
  /// From now on each Prefill, once recorded (prefills() lists it), waits until ReleasePrefills.
  void HoldPrefills();
  /// Lets held and later Prefills go on. Call it before stopping the fake's server.
  void ReleasePrefills();
  /// What GetInfo reports as instance_id from now on ("" until set): a new value plays a restart.
  void SetInstanceId(const std::string& instance_id);
  /// The next `count` Releases answer UNAVAILABLE and keep the sequence (a worker unreachable).
  void FailReleases(int count);

  /// A sequence's length (slots), nullopt if unknown.
  std::optional<int64_t> Length(uint64_t sequence_id);
  int NumSequences();
  std::vector<dsa::attention::v1::PrefillRequest> prefills();
  /// The `traceparent` metadata of each Prefill, in order ("" when absent).
  std::vector<std::string> prefill_traceparents();
  std::vector<dsa::attention::v1::ReleaseRequest> releases();
  std::vector<dsa::attention::v1::CommitRequest> commits();
  /// Every DecodeStep request answered OK, in order.
  std::vector<dsa::attention::v1::DecodeStepRequest> steps();
  /// The tiny real model's KV of a sequence: the token ids of its slots (empty if unknown).
  std::vector<int32_t> KvTokens(uint64_t sequence_id);
  int max_batch_size();
  int decode_steps();

  /// Each waits, on the fake's own state changes (no polling), until its condition holds; false
  /// after `timeout` (a test's safety net, not a pacing).
  /// releases().size() == count.
  bool AwaitReleases(size_t count, absl::Duration timeout = absl::Seconds(5));
  /// NumSequences() == count.
  bool AwaitNumSequences(int count, absl::Duration timeout = absl::Seconds(5));
  /// prefills().size() == count.
  bool AwaitPrefills(size_t count, absl::Duration timeout = absl::Seconds(5));
  /// decode_steps() > count.
  bool AwaitDecodeStepsOver(int count, absl::Duration timeout = absl::Seconds(5));

 private:
  struct Sequence {
    int64_t context_length = 0;
    int64_t length = 0;
    int pending_rows = 0;  // > 1 while a speculative step awaits Commit
    std::string indexer;
    std::vector<int32_t> kv;              // the tiny real model: the tokens of the slots
    std::vector<int32_t> pending_tokens;  // the rows' tokens of the step awaiting Commit
    dsa::attention::v1::SamplingParams sampling;
  };
  dsa::indexer::v1::IndexerService::Stub& IndexerStub(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `done` (called with mu_ held) is true, or `timeout` passes.
  bool AwaitState(std::function<bool()> done, absl::Duration timeout);
  // Appends zero keys for slots [first, last) of every layer on the indexer.
  grpc::Status AppendKeys(dsa::indexer::v1::IndexerService::Stub& stub, uint64_t sequence_id,
                          int64_t first, int64_t last);

  // Drops the sequences whose lease ended (`ids`) and those of leases expired by now.
  void DropLocked(const std::vector<uint64_t>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Shape shape_;
  SequenceLeases leases_{&RealClock()};
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<dsa::indexer::v1::IndexerService::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
  std::vector<dsa::attention::v1::PrefillRequest> prefills_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> prefill_traceparents_ ABSL_GUARDED_BY(mu_);
  int fail_releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<dsa::attention::v1::ReleaseRequest> releases_ ABSL_GUARDED_BY(mu_);
  std::vector<dsa::attention::v1::CommitRequest> commits_ ABSL_GUARDED_BY(mu_);
  std::vector<dsa::attention::v1::DecodeStepRequest> steps_ ABSL_GUARDED_BY(mu_);
  std::optional<int64_t> fail_context_ ABSL_GUARDED_BY(mu_);
  int step_delay_ms_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_prefills_ ABSL_GUARDED_BY(mu_) = false;
  int max_batch_size_ ABSL_GUARDED_BY(mu_) = 0;
  int decode_steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::string instance_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dsa::testing
