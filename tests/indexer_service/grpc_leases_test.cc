// Tests of the indexer adapter's coordinator leases (indexer_service/grpc_service.h,
// server/sequence_leases.h) on a FakeClock, its handlers called directly: the sequences of a
// lease that is not renewed are released with their blocks, renewals keep them, a new instance of
// the coordinator releases its predecessor's at once and refuses it, and a bad lease creates
// nothing.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::indexer::v1;

constexpr int64_t kCapacityBlocks = 64;

class IndexerLeasesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IndexerOptions options;
    options.capacity_blocks = kCapacityBlocks;
    options.num_heads = 4;
    options.head_dim = 16;
    absl::StatusOr<std::unique_ptr<Indexer>> indexer = Indexer::Create(options);
    ASSERT_TRUE(indexer.ok()) << indexer.status();
    indexer_ = *std::move(indexer);
    service_ = std::make_unique<IndexerServiceImpl>(indexer_.get(), nullptr,
                                                    std::vector<std::string>{}, &clock_);
  }

  static dsa::common::v1::Lease Lease(const std::string& instance, int64_t ttl_ms = 10000) {
    dsa::common::v1::Lease lease;
    lease.set_owner("coordinator-0");
    lease.set_instance_id(instance);
    lease.set_ttl_ms(ttl_ms);
    return lease;
  }

  // Creates sequence `id` under `lease` (none when null) and appends `slots` index keys to it.
  grpc::Status Create(uint64_t id, const dsa::common::v1::Lease* lease, int64_t slots = 128) {
    v1::CreateSequenceRequest request;
    request.set_sequence_id(id);
    request.set_num_layers(1);
    request.set_top_k(16);
    request.mutable_spin()->set_all_keep(true);
    if (lease != nullptr) *request.mutable_lease() = *lease;
    v1::CreateSequenceResponse response;
    grpc::Status status = service_->CreateSequence(nullptr, &request, &response);
    if (status.ok() && slots > 0) {
      const std::vector<float> keys(static_cast<size_t>(slots) * 16, 0.5f);
      EXPECT_TRUE(indexer_->AppendIndexKeys(id, 0, keys, slots).ok());
    }
    return status;
  }

  absl::StatusOr<dsa::common::v1::LeaseState> Renew(const dsa::common::v1::Lease& lease) {
    v1::RenewLeaseRequest request;
    *request.mutable_lease() = lease;
    v1::RenewLeaseResponse response;
    const grpc::Status status = service_->RenewLease(nullptr, &request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.state();
  }

  v1::GetLoadResponse Load() {
    v1::GetLoadRequest request;
    v1::GetLoadResponse response;
    EXPECT_TRUE(service_->GetLoad(nullptr, &request, &response).ok());
    return response;
  }

  FakeClock clock_;
  std::unique_ptr<Indexer> indexer_;
  std::unique_ptr<IndexerServiceImpl> service_;
};

TEST_F(IndexerLeasesTest, AnUnrenewedLeasesSequencesAreReleasedWithTheirBlocks) {
  const dsa::common::v1::Lease lease = Lease("i1");
  ASSERT_TRUE(Create(1, &lease).ok());
  ASSERT_TRUE(Create(2, &lease).ok());
  ASSERT_TRUE(Create(3, nullptr).ok());  // no lease: held until released
  EXPECT_EQ(Load().free_blocks(), kCapacityBlocks - 6);
  clock_.Advance(absl::Milliseconds(9999));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 0);
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 2);
  EXPECT_EQ(Load().sequences(), 1);
  EXPECT_EQ(Load().free_blocks(), kCapacityBlocks - 2);
  EXPECT_EQ(service_->owned_sequences(), 1);  // the released ids' owners are forgotten
  clock_.Advance(absl::Hours(1));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 0);
  EXPECT_EQ(Load().sequences(), 1);
}

TEST_F(IndexerLeasesTest, RenewalsKeepTheSequencesAndALateOneSaysTheyAreGone) {
  const dsa::common::v1::Lease lease = Lease("i1");
  ASSERT_TRUE(Create(1, &lease).ok());
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(6));
    absl::StatusOr<dsa::common::v1::LeaseState> state = Renew(lease);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_TRUE(state->renewed());
    EXPECT_EQ(state->sequences(), 1);
    EXPECT_EQ(service_->ReleaseExpiredLeases(), 0);
  }
  clock_.Advance(absl::Seconds(11));  // the coordinator paused past its ttl
  absl::StatusOr<dsa::common::v1::LeaseState> late = Renew(lease);
  ASSERT_TRUE(late.ok());
  EXPECT_FALSE(late->renewed());
  EXPECT_EQ(late->sequences(), 0);
  EXPECT_EQ(Load().sequences(), 0);
  EXPECT_EQ(Load().free_blocks(), kCapacityBlocks);
}

TEST_F(IndexerLeasesTest, ANewInstanceReleasesItsPredecessorsSequencesAndRefusesIt) {
  const dsa::common::v1::Lease old_lease = Lease("i1");
  ASSERT_TRUE(Create(1, &old_lease).ok());
  ASSERT_TRUE(Create(2, &old_lease).ok());
  absl::StatusOr<dsa::common::v1::LeaseState> state = Renew(Lease("i2"));
  ASSERT_TRUE(state.ok());
  EXPECT_FALSE(state->renewed());
  EXPECT_EQ(state->superseded_released(), 2);
  EXPECT_EQ(Load().sequences(), 0);
  EXPECT_EQ(Load().free_blocks(), kCapacityBlocks);
  // The predecessor, back from a pause, can neither create nor renew.
  const grpc::Status refused = Create(3, &old_lease);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("superseded"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Renew(old_lease).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Load().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0);
}

TEST_F(IndexerLeasesTest, ACreateWithABadLeaseCreatesNothing) {
  dsa::common::v1::Lease no_instance = Lease("");
  dsa::common::v1::Lease zero_ttl = Lease("i1", 0);
  dsa::common::v1::Lease long_ttl = Lease("i1", 600001);
  for (const dsa::common::v1::Lease* lease : {&no_instance, &zero_ttl, &long_ttl}) {
    const grpc::Status status = Create(5, lease);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_EQ(status.error_message().rfind("lease: ", 0), 0u) << status.error_message();
  }
  EXPECT_EQ(Load().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0);
  EXPECT_EQ(Renew(zero_ttl).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(IndexerLeasesTest, AReleasedSequenceLeavesItsLease) {
  const dsa::common::v1::Lease lease = Lease("i1");
  ASSERT_TRUE(Create(1, &lease).ok());
  ASSERT_TRUE(Create(2, &lease).ok());
  v1::ReleaseRequest release;
  release.set_sequence_id(1);
  v1::ReleaseResponse released;
  ASSERT_TRUE(service_->Release(nullptr, &release, &released).ok());
  EXPECT_EQ(service_->leases().leased_sequences(), 1);
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(service_->ReleaseExpiredLeases(), 1);
  EXPECT_EQ(Load().sequences(), 0);
}

}  // namespace
}  // namespace dsa
