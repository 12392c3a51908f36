// Tests of the attention worker's coordinator leases (attention_worker/service.h,
// server/sequence_leases.h) on a FakeClock shared with the indexer: a lease that is not renewed
// has its sequences released here and on the indexer (KV and index-key blocks back), a new
// coordinator instance releases its predecessor's at once and refuses it, a kept prefix donor is
// released by the indexer's own lease, and a co-located indexer holds its sequences under the same
// lease. The attention service's handlers are called directly; the indexer is a real service on
// 127.0.0.1:0 (or in process, co-located).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"
#include "tests/attention_worker/service_fixture.h"
#include "transport/in_process_indexer_client.h"

namespace dsa::attention_service_testing {
namespace {

constexpr int64_t kIndexerBlocks = 256;
constexpr int64_t kContext = 300;

class AttentionLeasesTest : public ::testing::Test {
 protected:
  // `colocated`: the indexer in process (InProcessIndexerClient), its service shared
  // (ShareIndexerWith), as dsa-attention --transport inprocess wires them.
  void Start(bool colocated = false) {
    indexer_ = StartIndexer(kIndexerBlocks, kH, kD, 0, &clock_);
    auto schedule = MliSchedule::FromPattern("FSFS", 1);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    PatternModelConfig config = SpinFigurePatternConfig();
    config.num_layers = static_cast<int>(schedule->full_layers().size());
    config.num_heads = kH;
    config.head_dim = kD;
    config.seed = kSeed;
    config.num_diagonals = 2;  // of round(0.25 * 8) = 2 positional heads
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok()) << model.status();
    AttentionWorkerOptions options;
    options.kv_dim = kKvDim;
    options.attention_heads = kAttentionHeads;
    options.seed = kSeed;
    IndexerClientFactory clients =
        colocated ? InProcessIndexerClient::Factory(indexer_->indexer.get(), nullptr,
                                                    [](const std::string&) { return true; })
                  : GrpcIndexerClient::Factory();
    auto engine = MakeCpuAttentionEngine(*schedule, *model, options, std::move(clients));
    ASSERT_TRUE(engine.ok()) << engine.status();
    service_ = std::make_unique<AttentionServiceImpl>(*std::move(engine), &clock_);
    if (colocated) service_->ShareIndexerWith(indexer_->service.get());
  }

  void TearDown() override {
    if (service_) service_->CloseTransports();
  }

  static dsa::common::v1::Lease Lease(const std::string& instance) {
    dsa::common::v1::Lease lease;
    lease.set_owner("coordinator-0");
    lease.set_instance_id(instance);
    lease.set_ttl_ms(10000);
    return lease;
  }

  grpc::Status Prefill(uint64_t id, const dsa::common::v1::Lease& lease) {
    av1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_context_length(kContext);
    request.set_indexer_worker(indexer_->address);
    request.mutable_settings()->set_top_k(kK);
    request.mutable_settings()->mutable_spin()->set_all_keep(true);
    *request.mutable_lease() = lease;
    av1::PrefillResponse response;
    return service_->Prefill(nullptr, &request, &response);
  }

  absl::StatusOr<dsa::common::v1::LeaseState> Renew(const dsa::common::v1::Lease& lease) {
    av1::RenewLeaseRequest request;
    *request.mutable_lease() = lease;
    av1::RenewLeaseResponse response;
    const grpc::Status status = service_->RenewLease(nullptr, &request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.state();
  }

  av1::GetInfoResponse Info() {
    av1::GetInfoResponse info;
    EXPECT_TRUE(service_->GetInfo(nullptr, nullptr, &info).ok());
    return info;
  }

  // The indexer's sequences, read from the engine (the co-located one has no client of its own).
  int64_t IndexerSequences() const { return indexer_->indexer->num_sequences(); }
  int64_t IndexerFreeBlocks() const { return indexer_->indexer->Usage().free_blocks; }

  FakeClock clock_;
  std::unique_ptr<IndexerServer> indexer_;
  std::unique_ptr<AttentionServiceImpl> service_;
};

TEST_F(AttentionLeasesTest, AnUnrenewedLeasesSequencesAreReleasedHereAndOnTheIndexer) {
  Start();
  ASSERT_TRUE(Prefill(1, Lease("i1")).ok());
  ASSERT_TRUE(Prefill(2, Lease("i1")).ok());
  EXPECT_EQ(Info().sequences(), 2);
  EXPECT_GT(Info().kv_used_slots(), 0);
  EXPECT_EQ(IndexerSequences(), 2);
  EXPECT_EQ(indexer_->service->leases().leased_sequences(), 2);  // the lease crossed the wire
  clock_.Advance(absl::Seconds(5));
  ASSERT_TRUE(Renew(Lease("i1")).ok());
  clock_.Advance(absl::Seconds(9));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 0);  // renewed 9 s ago
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 2);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(IndexerSequences(), 0);
  EXPECT_EQ(IndexerFreeBlocks(), kIndexerBlocks);
  EXPECT_EQ(service_->owned_sequences(), 0);
  EXPECT_EQ(indexer_->service->owned_sequences(), 0);
}

TEST_F(AttentionLeasesTest, ANewInstanceReleasesItsPredecessorsSequencesAndRefusesIt) {
  Start();
  ASSERT_TRUE(Prefill(1, Lease("i1")).ok());
  ASSERT_TRUE(Prefill(2, Lease("i1")).ok());
  absl::StatusOr<dsa::common::v1::LeaseState> state = Renew(Lease("i2"));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_FALSE(state->renewed());
  EXPECT_EQ(state->superseded_released(), 2);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(IndexerSequences(), 0);
  const grpc::Status refused = Prefill(3, Lease("i1"));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message().rfind("lease: ", 0), 0u) << refused.error_message();
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(IndexerSequences(), 0);
  // The successor prefills under its own lease.
  ASSERT_TRUE(Prefill(3, Lease("i2")).ok());
  EXPECT_EQ(Renew(Lease("i2"))->sequences(), 1);
}

TEST_F(AttentionLeasesTest, AKeptPrefixDonorIsReleasedByTheIndexersLease) {
  Start();
  ASSERT_TRUE(Prefill(1, Lease("i1")).ok());
  av1::ReleaseRequest release;
  release.set_sequence_id(1);
  release.set_keep_indexer_sequence(true);
  av1::ReleaseResponse released;
  ASSERT_TRUE(service_->Release(nullptr, &release, &released).ok());
  EXPECT_EQ(service_->leases().leased_sequences(), 0);
  EXPECT_EQ(IndexerSequences(), 1);
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 0);
  EXPECT_EQ(indexer_->service->ReleaseExpiredLeases(), 1);
  EXPECT_EQ(IndexerSequences(), 0);
  EXPECT_EQ(IndexerFreeBlocks(), kIndexerBlocks);
}

TEST_F(AttentionLeasesTest, ACoLocatedIndexerHoldsItsSequencesUnderTheSameLease) {
  Start(/*colocated=*/true);
  ASSERT_TRUE(Prefill(1, Lease("i1")).ok());
  ASSERT_TRUE(Prefill(2, Lease("i1")).ok());
  EXPECT_EQ(indexer_->service->leases().leased_sequences(), 2);
  // 1 is kept as a donor: the attention side lets it go, the indexer's lease keeps it.
  av1::ReleaseRequest release;
  release.set_sequence_id(1);
  release.set_keep_indexer_sequence(true);
  av1::ReleaseResponse released;
  ASSERT_TRUE(service_->Release(nullptr, &release, &released).ok());
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 1);  // 2, here and on the indexer
  EXPECT_EQ(IndexerSequences(), 1);
  EXPECT_EQ(indexer_->service->ReleaseExpiredLeases(), 1);  // the donor
  EXPECT_EQ(IndexerSequences(), 0);
  EXPECT_EQ(IndexerFreeBlocks(), kIndexerBlocks);
  EXPECT_EQ(indexer_->service->owned_sequences(), 0);
}

TEST_F(AttentionLeasesTest, ABadLeasePrefillsNothing) {
  Start();
  dsa::common::v1::Lease bad = Lease("i1");
  bad.set_ttl_ms(-5);
  const grpc::Status status = Prefill(1, bad);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(IndexerSequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0);
}

}  // namespace
}  // namespace dsa::attention_service_testing
