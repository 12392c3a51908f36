// Tests of the OpenDataPlane RPC's adapter without NCCL: no data plane factory -> UNIMPLEMENTED;
// an injected one is called with the request and its status and response come back unchanged;
// under mutual TLS it gets the caller's identity and an owner check that refuses another
// caller's sequences.
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "server/security.h"
#include "tests/testing/loopback_server.h"
#include "tests/testing/test_pki.h"

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
  service_->SetDataPlaneOpener([&](const v1::OpenDataPlaneRequest& request,
                                   const DataPlaneCaller& caller,
                                   v1::OpenDataPlaneResponse* response) {
    EXPECT_EQ(caller.identity, "");  // plaintext: the anonymous caller
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
  service_->SetDataPlaneOpener(
      [](const v1::OpenDataPlaneRequest&, const DataPlaneCaller&, v1::OpenDataPlaneResponse*) {
        return absl::FailedPreconditionError(
            "OpenDataPlane: this dsa-indexer was started without --device cuda");
      });
  EXPECT_EQ(Call(request, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// Under mutual TLS the opener learns who opened the data plane, and its owner check holds the
// selects that will come over the data plane to that caller's sequences, as SelectStream does:
// another caller's sequence is PERMISSION_DENIED, the caller's own and unowned ones pass, and the
// operator (the coordinator) passes for any.
TEST(OpenDataPlaneSecurityTest, TheOpenerGetsTheCallerAndAnOwnerCheckForItsSequences) {
  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  const testing::TestIdentity server_cert = pki.Issue("indexer-0");
  const testing::TestIdentity a_cert = pki.Issue("attention-a");
  const testing::TestIdentity b_cert = pki.Issue("attention-b");
  const testing::TestIdentity operator_cert = pki.Issue("coordinator");
  ASSERT_FALSE(operator_cert.cert.empty());
  auto indexer = Indexer::Create({.capacity_blocks = 4, .num_heads = 4, .head_dim = 8});
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  IndexerServiceImpl service(indexer->get(), nullptr, {"coordinator"});
  std::vector<DataPlaneCaller> callers;
  std::mutex mutex;
  service.SetDataPlaneOpener([&](const v1::OpenDataPlaneRequest&, const DataPlaneCaller& caller,
                                 v1::OpenDataPlaneResponse*) {
    std::lock_guard<std::mutex> lock(mutex);
    callers.push_back(caller);
    return absl::OkStatus();
  });
  TlsFlags server_flags;
  server_flags.cert_file = server_cert.cert;
  server_flags.key_file = server_cert.key;
  server_flags.client_ca_file = pki.ca();
  auto credentials = ServerCredentialsFrom(server_flags);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  std::string address;
  std::unique_ptr<grpc::Server> server = testing::ServeOnLoopback(&service, &address, *credentials);
  ASSERT_NE(server, nullptr);
  auto stub_of = [&](const testing::TestIdentity& identity) {
    TlsFlags client_flags;
    client_flags.cert_file = identity.cert;
    client_flags.key_file = identity.key;
    client_flags.ca_file = pki.ca();
    auto security = ClientSecurityFrom(client_flags);
    EXPECT_TRUE(security.ok()) << security.status();
    return v1::IndexerService::NewStub(NewChannel(address, security.value_or(ClientSecurity{})));
  };
  auto a = stub_of(a_cert), b = stub_of(b_cert), coordinator = stub_of(operator_cert);
  // attention-a creates sequence 7.
  {
    grpc::ClientContext context;
    v1::CreateSequenceRequest create;
    create.set_sequence_id(7);
    create.set_num_layers(1);
    create.set_top_k(4);
    v1::CreateSequenceResponse created;
    const grpc::Status status = a->CreateSequence(&context, create, &created);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  for (auto* stub : {a.get(), b.get(), coordinator.get()}) {
    grpc::ClientContext context;
    v1::OpenDataPlaneRequest request;
    v1::OpenDataPlaneResponse response;
    const grpc::Status status = stub->OpenDataPlane(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_EQ(callers.size(), 3u);
  EXPECT_EQ(callers[0].identity, "attention-a");
  EXPECT_EQ(callers[1].identity, "attention-b");
  EXPECT_EQ(callers[2].identity, "coordinator");
  EXPECT_TRUE(callers[0].check_owned(7).ok());
  const absl::Status theirs = callers[1].check_owned(7);
  EXPECT_EQ(theirs.code(), absl::StatusCode::kPermissionDenied) << theirs;
  EXPECT_NE(theirs.message().find("sequence 7 belongs to another caller"), std::string::npos)
      << theirs;
  EXPECT_TRUE(callers[1].check_owned(8).ok());  // no owner yet
  EXPECT_TRUE(callers[2].check_owned(7).ok());  // the operator
  server->Shutdown();
}

}  // namespace
}  // namespace dsa
