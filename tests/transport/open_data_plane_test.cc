// Tests of the OpenDataPlane RPC's adapter without NCCL: no data plane factory -> UNIMPLEMENTED;
// an injected one is called with the request and its status and response come back unchanged.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"

namespace dsa {
namespace {

namespace v1 = dsa::indexer::v1;

class OpenDataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    indexer_ = std::move(*Indexer::Create({.capacity_blocks = 4, .num_heads = 4, .head_dim = 8}));
    service_ = std::make_unique<IndexerServiceImpl>(indexer_.get());
  }
  grpc::Status Call(const v1::OpenDataPlaneRequest& request, v1::OpenDataPlaneResponse* response) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    auto stub = v1::IndexerService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    const grpc::Status status = stub->OpenDataPlane(&context, request, response);
    server->Shutdown();
    return status;
  }
  std::unique_ptr<Indexer> indexer_;
  std::unique_ptr<IndexerServiceImpl> service_;
};

TEST_F(OpenDataPlaneTest, WithoutAFactoryTheRpcIsUnimplemented) {
  v1::OpenDataPlaneResponse response;
  const grpc::Status status = Call({}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(status.error_message().find("without NCCL"), std::string::npos)
      << status.error_message();
}

TEST_F(OpenDataPlaneTest, TheInjectedFactoryAnswers) {
  std::string seen_worker;
  service_->SetDataPlaneOpener(
      [&](const v1::OpenDataPlaneRequest& request, v1::OpenDataPlaneResponse* response) {
        seen_worker = request.attention_worker();
        if (request.head_dim() != 8) {
          return absl::InvalidArgumentError("head_dim (D) 9 differs from this indexer's 8");
        }
        response->set_data_plane_id(5);
        return absl::OkStatus();
      });
  v1::OpenDataPlaneRequest request;
  request.set_attention_worker("attention-0");
  request.set_head_dim(8);
  v1::OpenDataPlaneResponse response;
  ASSERT_TRUE(Call(request, &response).ok());
  EXPECT_EQ(seen_worker, "attention-0");
  EXPECT_EQ(response.data_plane_id(), 5u);
  request.set_head_dim(9);
  const grpc::Status refused = Call(request, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("head_dim"), std::string::npos);
  // A factory that says there is no GPU (dsa-indexer started without --device cuda).
  service_->SetDataPlaneOpener([](const v1::OpenDataPlaneRequest&, v1::OpenDataPlaneResponse*) {
    return absl::FailedPreconditionError(
        "OpenDataPlane: this dsa-indexer was started without --device cuda");
  });
  EXPECT_EQ(Call(request, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace dsa
