// Tests of server/server.h's ListenExclusively: a second server on a port in use fails to start
// instead of sharing the port with the first.
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace dsa {
namespace {

std::unique_ptr<grpc::Server> Start(const std::string& address, bool exclusive, int* port) {
  grpc::ServerBuilder builder;
  if (exclusive) {
    ListenExclusively(builder, address, grpc::InsecureServerCredentials(), port);
  } else {
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  }
  return builder.BuildAndStart();
}

TEST(ListenExclusivelyTest, ASecondServerOnAPortInUseFailsToStart) {
  int first_port = 0;
  std::unique_ptr<grpc::Server> first = Start("127.0.0.1:0", /*exclusive=*/true, &first_port);
  ASSERT_NE(first, nullptr);
  ASSERT_GT(first_port, 0);
  int second_port = 0;
  std::unique_ptr<grpc::Server> second =
      Start("127.0.0.1:" + std::to_string(first_port), /*exclusive=*/true, &second_port);
  EXPECT_TRUE(second == nullptr || second_port == 0);
  first->Shutdown();
}

// gRPC's default, which ListenExclusively turns off: with reuse-port on (both servers asking for
// it), the second server binds the port in use, and connections are spread between the two.
TEST(ListenExclusivelyTest, WithGrpcsDefaultASecondServerSharesThePort) {
  int first_port = 0;
  std::unique_ptr<grpc::Server> first = Start("127.0.0.1:0", /*exclusive=*/false, &first_port);
  ASSERT_NE(first, nullptr);
  int second_port = 0;
  std::unique_ptr<grpc::Server> second =
      Start("127.0.0.1:" + std::to_string(first_port), /*exclusive=*/false, &second_port);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second_port, first_port);
  second->Shutdown();
  first->Shutdown();
}

// A first server started exclusively keeps its port even from one that asks for sharing.
TEST(ListenExclusivelyTest, AnExclusiveServersPortIsNotSharedWithADefaultOne) {
  int first_port = 0;
  std::unique_ptr<grpc::Server> first = Start("127.0.0.1:0", /*exclusive=*/true, &first_port);
  ASSERT_NE(first, nullptr);
  int second_port = 0;
  std::unique_ptr<grpc::Server> second =
      Start("127.0.0.1:" + std::to_string(first_port), /*exclusive=*/false, &second_port);
  EXPECT_TRUE(second == nullptr || second_port == 0);
  first->Shutdown();
}

}  // namespace
}  // namespace dsa
