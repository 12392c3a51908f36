// Tests that DSA_RETURN_IF_ERROR and DSA_ASSIGN_OR_RETURN (common/status_macros.h) propagate errors
// and pass values through.
#include "common/status_macros.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

int g_evaluations = 0;

absl::Status Check(bool ok) {
  ++g_evaluations;
  return ok ? absl::OkStatus() : absl::NotFoundError("no such sequence");
}

absl::StatusOr<std::unique_ptr<int>> MakeValue(int value) {
  ++g_evaluations;
  if (value < 0) return absl::OutOfRangeError("negative");
  return std::make_unique<int>(value);
}

// Runs Check(first), then Check(second); *reached (1, 2 or 3) tells how far it got.
absl::Status TwoChecks(bool first, bool second, int* reached) {
  *reached = 1;
  DSA_RETURN_IF_ERROR(Check(first));
  *reached = 2;
  DSA_RETURN_IF_ERROR(Check(second));
  *reached = 3;
  return absl::OkStatus();
}

absl::StatusOr<int> SumOfTwo(int a, int b) {
  DSA_ASSIGN_OR_RETURN(auto first, MakeValue(a));  // a declaration
  std::unique_ptr<int> second;
  DSA_ASSIGN_OR_RETURN(second, MakeValue(b));  // an existing variable, move-only type
  return *first + *second;
}

TEST(StatusMacrosTest, ReturnIfErrorPassesOkThrough) {
  g_evaluations = 0;
  int reached = 0;
  EXPECT_TRUE(TwoChecks(true, true, &reached).ok());
  EXPECT_EQ(reached, 3);
  EXPECT_EQ(g_evaluations, 2);  // each expression evaluated once
}

TEST(StatusMacrosTest, ReturnIfErrorReturnsTheFirstError) {
  g_evaluations = 0;
  int reached = 0;
  const absl::Status status = TwoChecks(false, true, &reached);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "no such sequence");
  EXPECT_EQ(reached, 1);
  EXPECT_EQ(g_evaluations, 1);

  const absl::Status second = TwoChecks(true, false, &reached);
  EXPECT_EQ(second.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reached, 2);
}

TEST(StatusMacrosTest, AssignOrReturnAssignsValues) {
  g_evaluations = 0;
  const absl::StatusOr<int> sum = SumOfTwo(2, 40);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(*sum, 42);
  EXPECT_EQ(g_evaluations, 2);
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesTheError) {
  g_evaluations = 0;
  const absl::StatusOr<int> first_fails = SumOfTwo(-1, 40);
  EXPECT_EQ(first_fails.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(first_fails.status().message(), "negative");
  EXPECT_EQ(g_evaluations, 1);  // stopped before the second call

  const absl::StatusOr<int> second_fails = SumOfTwo(1, -1);
  EXPECT_EQ(second_fails.status().code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace dsa
