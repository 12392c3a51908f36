// Tests of the seeded speculative acceptance model.
#include "coordinator/acceptance_model.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(AcceptanceModel, RejectsOutOfRangeSettings) {
  EXPECT_EQ(AcceptanceModel::Create(-0.1, 3, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AcceptanceModel::Create(1.5, 3, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AcceptanceModel::Create(NAN, 3, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AcceptanceModel::Create(0.5, 5, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AcceptanceModel::Create(0.5, -1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AcceptanceModel, ExtremeRatesAcceptAllOrNothing) {
  auto all = AcceptanceModel::Create(1.0, 3, 7);
  auto none = AcceptanceModel::Create(0.0, 3, 7);
  ASSERT_TRUE(all.ok() && none.ok());
  for (uint64_t step = 0; step < 100; ++step) {
    EXPECT_EQ(all->Accepted(step), 3);
    EXPECT_EQ(none->Accepted(step), 0);
  }
  EXPECT_DOUBLE_EQ(all->ExpectedAccepted(), 3.0);
  EXPECT_DOUBLE_EQ(none->ExpectedAccepted(), 0.0);
}

TEST(AcceptanceModel, DistributionMatchesTruncatedGeometric) {
  const double p = 0.7;
  auto model = AcceptanceModel::Create(p, 3, 42);
  ASSERT_TRUE(model.ok());
  EXPECT_NEAR(model->ExpectedAccepted(), 0.7 + 0.49 + 0.343, 1e-12);
  const int n = 200000;
  std::vector<int> counts(4, 0);
  for (int step = 0; step < n; ++step) ++counts[model->Accepted(step)];
  // P(a=0)=0.3, P(1)=0.21, P(2)=0.147, P(3)=0.343; 5 sigma of a binomial at n = 2e5 is < 0.006.
  const double expected[4] = {0.3, 0.21, 0.147, 0.343};
  for (int a = 0; a < 4; ++a)
    EXPECT_NEAR(counts[a] / static_cast<double>(n), expected[a], 0.006) << a;
}

TEST(AcceptanceModel, SameSeedSameDrawsOtherSeedDiffers) {
  auto a = AcceptanceModel::Create(0.6, 3, 1);
  auto b = AcceptanceModel::Create(0.6, 3, 1);
  auto c = AcceptanceModel::Create(0.6, 3, 2);
  int differ = 0;
  for (uint64_t step = 0; step < 200; ++step) {
    EXPECT_EQ(a->Accepted(step), b->Accepted(step));
    differ += a->Accepted(step) != c->Accepted(step);
  }
  EXPECT_GT(differ, 50);
}

}  // namespace
}  // namespace dsa
