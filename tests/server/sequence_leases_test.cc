// Tests of server/sequence_leases.h on a FakeClock: expiry after the ttl and not before, renewal
// that extends, a late renewal that does not revive, a new instance that supersedes the old (which
// is refused from then on), owners bound to their caller, and bad leases refused unchanged.
#include "server/sequence_leases.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

SequenceLease Lease(const std::string& owner, const std::string& instance,
                    absl::Duration ttl = absl::Seconds(10)) {
  return SequenceLease{.owner = owner, .instance_id = instance, .ttl = ttl};
}

std::vector<uint64_t> Sorted(std::vector<uint64_t> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}

TEST(SequenceLeasesTest, ALeaseNotRenewedForItsTtlHandsItsSequencesBack) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(2, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(3, Lease("other", "j1", absl::Seconds(30)), "").ok());
  clock.Advance(absl::Seconds(10) - absl::Milliseconds(1));
  EXPECT_TRUE(leases.TakeExpired().empty());
  clock.Advance(absl::Milliseconds(1));
  EXPECT_EQ(Sorted(leases.TakeExpired()), (std::vector<uint64_t>{1, 2}));
  EXPECT_TRUE(leases.TakeExpired().empty());  // handed back once
  EXPECT_EQ(leases.leased_sequences(), 1);
  EXPECT_EQ(leases.live_leases(), 1);
}

TEST(SequenceLeasesTest, ARenewalExtendsTheLease) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Seconds(6));
    absl::StatusOr<SequenceLeases::Renewal> renewal = leases.Renew(Lease("c", "i1"), "");
    ASSERT_TRUE(renewal.ok()) << renewal.status();
    EXPECT_TRUE(renewal->renewed);
    EXPECT_EQ(renewal->sequences, 1);
    EXPECT_TRUE(renewal->released.empty());
    EXPECT_TRUE(leases.TakeExpired().empty());
  }
}

TEST(SequenceLeasesTest, ALateRenewalStartsANewLeaseAndReleasesTheOldOnesSequences) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(7, Lease("c", "i1"), "").ok());
  clock.Advance(absl::Seconds(11));  // expired, not swept yet
  absl::StatusOr<SequenceLeases::Renewal> renewal = leases.Renew(Lease("c", "i1"), "");
  ASSERT_TRUE(renewal.ok());
  EXPECT_FALSE(renewal->renewed);
  EXPECT_EQ(renewal->sequences, 0);
  EXPECT_EQ(renewal->released, std::vector<uint64_t>{7});
  EXPECT_EQ(renewal->superseded, 0);
  EXPECT_EQ(leases.leased_sequences(), 0);
  // The new lease is live and renews.
  clock.Advance(absl::Seconds(5));
  EXPECT_TRUE(leases.Renew(Lease("c", "i1"), "")->renewed);
}

TEST(SequenceLeasesTest, ANewInstanceSupersedesTheOldAtOnceAndTheOldIsRefused) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(2, Lease("c", "i1"), "").ok());
  absl::StatusOr<SequenceLeases::Renewal> renewal = leases.Renew(Lease("c", "i2"), "");
  ASSERT_TRUE(renewal.ok());
  EXPECT_FALSE(renewal->renewed);
  EXPECT_EQ(renewal->superseded, 2);
  EXPECT_EQ(Sorted(renewal->released), (std::vector<uint64_t>{1, 2}));
  // The paused predecessor comes back: refused, and its successor's lease is untouched.
  ASSERT_TRUE(leases.Attach(3, Lease("c", "i2"), "").ok());
  const absl::Status stale = leases.Renew(Lease("c", "i1"), "").status();
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_NE(stale.message().find("superseded by instance i2"), absl::string_view::npos) << stale;
  EXPECT_EQ(leases.Attach(4, Lease("c", "i1"), "").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(leases.Check(Lease("c", "i1"), "").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(leases.leased_sequences(), 1);
  EXPECT_TRUE(leases.Renew(Lease("c", "i2"), "")->renewed);
}

TEST(SequenceLeasesTest, AnAttachUnderANewInstanceKeepsItsOwnSequence) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(2, Lease("c", "i1"), "").ok());
  // Sequence 2 continued by the new instance: 1 is released, 2 moves to the new lease.
  absl::StatusOr<SequenceLeases::Renewal> renewal = leases.Attach(2, Lease("c", "i2"), "");
  ASSERT_TRUE(renewal.ok());
  EXPECT_EQ(renewal->released, std::vector<uint64_t>{1});
  EXPECT_EQ(renewal->sequences, 1);
  clock.Advance(absl::Seconds(10));
  EXPECT_EQ(leases.TakeExpired(), std::vector<uint64_t>{2});
}

TEST(SequenceLeasesTest, DetachedAndUnleasedSequencesAreNeverHandedBack) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(2, Lease("c", "i1"), "").ok());
  ASSERT_TRUE(leases.Attach(3, SequenceLease{}, "").ok());  // no lease
  leases.Detach(1);
  leases.Detach(99);  // under none
  // An empty lease takes a sequence out of its lease.
  ASSERT_TRUE(leases.Attach(2, SequenceLease{}, "").ok());
  clock.Advance(absl::Hours(1));
  EXPECT_TRUE(leases.TakeExpired().empty());
  EXPECT_EQ(leases.leased_sequences(), 0);
}

TEST(SequenceLeasesTest, AnOwnerBelongsToItsFirstCaller) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "coordinator").ok());
  const absl::Status denied = leases.Renew(Lease("c", "i2"), "tenant-a").status();
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  EXPECT_EQ(denied.message().find("i1"), absl::string_view::npos) << "names no instance";
  EXPECT_EQ(leases.Attach(2, Lease("c", "i1"), "tenant-a").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Nothing changed: the owner's lease still holds its sequence and renews.
  EXPECT_EQ(leases.leased_sequences(), 1);
  EXPECT_TRUE(leases.Renew(Lease("c", "i1"), "coordinator")->renewed);
}

TEST(SequenceLeasesTest, BadLeasesAreRefusedAndChangeNothing) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  ASSERT_TRUE(leases.Attach(1, Lease("c", "i1"), "").ok());
  const std::vector<SequenceLease> bad = {
      Lease("c", ""),
      Lease("c", "i2", absl::ZeroDuration()),
      Lease("c", "i2", -absl::Seconds(1)),
      Lease("c", "i2", kMaxLeaseTtl + absl::Milliseconds(1)),
      Lease(std::string(SequenceLeases::kMaxNameBytes + 1, 'x'), "i"),
      Lease("c", std::string(SequenceLeases::kMaxNameBytes + 1, 'x')),
  };
  for (const SequenceLease& lease : bad) {
    EXPECT_EQ(leases.Renew(lease, "").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(leases.Attach(2, lease, "").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(leases.Check(lease, "").code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(leases.Renew(SequenceLease{}, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(leases.leased_sequences(), 1);
  EXPECT_TRUE(leases.Renew(Lease("c", "i1"), "")->renewed);  // i1 was never superseded
}

TEST(SequenceLeasesTest, OwnersPastTheBoundEvictOnesWithoutALiveLease) {
  FakeClock clock;
  SequenceLeases leases(&clock);
  for (size_t i = 0; i < SequenceLeases::kMaxOwners; ++i) {
    ASSERT_TRUE(leases.Renew(Lease("owner" + std::to_string(i), "i"), "").ok());
  }
  const absl::Status full = leases.Renew(Lease("one-more", "i"), "").status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  clock.Advance(absl::Seconds(10));
  EXPECT_TRUE(leases.TakeExpired().empty());  // they held no sequences
  EXPECT_EQ(leases.live_leases(), 0);
  EXPECT_TRUE(leases.Renew(Lease("one-more", "i"), "").ok());
}

}  // namespace
}  // namespace dsa
