// The dsa-indexer binary's OpenDataPlane as a real process on loopback: with --device cpu it
// answers FAILED_PRECONDITION in a build with NCCL (the data plane needs the GPU), UNIMPLEMENTED
// in a build without.
#include <signal.h>

#include <chrono>
#include <string>

#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"

namespace {

namespace v1 = ::dsa::indexer::v1;

TEST(DsaIndexerDataPlaneTest, OpenDataPlaneWithoutAGpuSaysWhy) {
  const dsa::testing::Process process = dsa::testing::StartServer(
      DSA_INDEXER_BINARY, {"--capacity-blocks", "16", "--num-heads", "4", "--head-dim", "16"});
  ASSERT_FALSE(process.address.empty());
  auto stub = v1::IndexerService::NewStub(
      grpc::CreateChannel(process.address, grpc::InsecureChannelCredentials()));
  v1::OpenDataPlaneRequest request;
  request.set_nccl_unique_id(std::string(128, '\0'));
  request.set_num_ranks(2);
  request.set_indexer_rank(1);
  request.set_num_heads(4);
  request.set_head_dim(16);
  request.set_max_top_k(2048);
  request.set_max_message_bytes(1 << 20);
  v1::OpenDataPlaneResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::Status status = stub->OpenDataPlane(&context, request, &response);
#ifdef DSA_BUILT_WITH_NCCL
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_NE(status.error_message().find("--device cuda"), std::string::npos)
      << status.error_message();
#else
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  EXPECT_NE(status.error_message().find("without NCCL"), std::string::npos)
      << status.error_message();
#endif
  kill(process.pid, SIGTERM);
  EXPECT_EQ(dsa::testing::WaitExit(process.pid, std::chrono::seconds(20)), 0);
}

}  // namespace
