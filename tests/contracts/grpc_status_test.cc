// Tests of contracts/grpc_status.h: codes and messages carried both ways, and a message past
// kMaxStatusMessageBytes cut so that it still fits gRPC's metadata limit.
#include "contracts/grpc_status.h"

#include <string>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(GrpcStatusTest, CodesAndMessagesCrossBothWays) {
  const grpc::Status to = ToGrpcStatus(absl::NotFoundError("sequence 7 not found"));
  EXPECT_EQ(to.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(to.error_message(), "sequence 7 not found");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const absl::Status from =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"), "indexer worker a:1");
  EXPECT_EQ(from.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(from.message(), "indexer worker a:1: gone");
}

TEST(GrpcStatusTest, AMessagePastTheLimitIsCutAndSaysSo) {
  const std::string exact(kMaxStatusMessageBytes, 'x');
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError(exact)).error_message(), exact);
  const std::string long_message(3 * kMaxStatusMessageBytes, 'y');
  const grpc::Status cut = ToGrpcStatus(absl::InvalidArgumentError(long_message));
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LE(cut.error_message().size(), kMaxStatusMessageBytes);
  EXPECT_EQ(cut.error_message().rfind(std::string(100, 'y'), 0), 0u);
  const size_t kept = cut.error_message().find("...");
  ASSERT_NE(kept, std::string::npos);
  EXPECT_NE(
      cut.error_message().find(std::to_string(long_message.size() - kept) + " more bytes cut"),
      std::string::npos)
      << cut.error_message();
}

}  // namespace
}  // namespace dsa
