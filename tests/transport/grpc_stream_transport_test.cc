// Tests of the gRPC stream transport against a real in-process indexer server on loopback: layers
// submitted ahead and awaited later get the engine's own answers; a refused request ends the
// stream with the indexer's status; ids, deadlines and closing behave as documented.
#include "transport/grpc_stream_transport.h"

#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "tensor_codec.h"

namespace dsa {
namespace {

namespace v1 = dsa::indexer::v1;
constexpr int kH = 4, kD = 16, kK = 32, kLayers = 2, kSlots = 500;

class TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IndexerOptions options{.capacity_blocks = 64, .num_heads = kH, .head_dim = kD};
    indexer_ = std::move(*Indexer::Create(options));
    twin_ = std::move(*Indexer::Create(options));
    SequenceOptions sequence;
    sequence.num_layers = kLayers;
    sequence.top_k = kK;
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> keys(kSlots * kD);
    for (Indexer* x : {indexer_.get(), twin_.get()})
      ASSERT_TRUE(x->CreateSequence(7, sequence).ok());
    for (int layer = 0; layer < kLayers; ++layer) {
      for (float& v : keys) v = normal(rng);
      for (Indexer* x : {indexer_.get(), twin_.get()}) {
        ASSERT_TRUE(x->AppendIndexKeys(7, layer, keys, kSlots).ok());
      }
    }
    for (float& v : query_) v = normal(rng);
    for (float& v : weights_) v = std::abs(normal(rng));
    service_ = std::make_unique<IndexerServiceImpl>(indexer_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override { server_->Shutdown(); }

  v1::SelectRequest Request(uint64_t sequence, int layer, int64_t position) {
    v1::SelectRequest request;
    v1::RowGroup* group = request.add_groups();
    group->set_sequence_id(sequence);
    group->set_layer(layer);
    group->set_first_position(position);
    const int64_t query_shape[] = {1, kH, kD};
    const int64_t weight_shape[] = {1, kH};
    EncodeFloatTensor(query_, query_shape, group->mutable_queries());
    EncodeFloatTensor(weights_, weight_shape, group->mutable_head_weights());
    return request;
  }

  std::vector<int32_t> TwinSelection(int layer, int64_t position) {
    const IndexerRow row{query_, weights_, position};
    auto result = twin_->Select(7, layer, std::span<const IndexerRow>(&row, 1));
    EXPECT_TRUE(result.ok()) << result.status();
    return result->selections;
  }

  std::unique_ptr<Indexer> indexer_, twin_;
  std::unique_ptr<IndexerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<float> query_ = std::vector<float>(kH * kD);
  std::vector<float> weights_ = std::vector<float>(kH);
};

TEST_F(TransportTest, LayersSubmittedAheadAreAwaitedLaterWithTheEnginesAnswers) {
  GrpcStreamTransport transport(channel_);
  auto first = transport.Submit(Request(7, 0, kSlots - 1));
  auto second = transport.Submit(Request(7, 1, kSlots - 1));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(*first, *second);
  // Collected out of order, as a later layer may need an earlier full layer's selection.
  for (auto [id, layer] : {std::pair{*second, 1}, std::pair{*first, 0}}) {
    auto response = transport.Await(id, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->request_id(), id);
    ASSERT_EQ(response->selections_size(), 1);
    const int64_t shape[] = {1, kK};
    auto selection = DecodeInt32Tensor(response->selections(0).selections(), shape, "selections");
    ASSERT_TRUE(selection.ok()) << selection.status();
    EXPECT_EQ(*selection, TwinSelection(layer, kSlots - 1)) << "layer " << layer;
  }
  EXPECT_EQ(transport.Await(*first, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(transport.Await(12345, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(transport.Close().ok());
  EXPECT_EQ(transport.Submit(Request(7, 0, kSlots - 1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(TransportTest, ARefusedRequestGetsTheIndexersStatusAndOthersGoOn) {
  GrpcStreamTransport transport(channel_);
  auto bad = transport.Submit(Request(99, 0, kSlots - 1));  // unknown sequence
  auto good = transport.Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(bad.ok() && good.ok());
  const absl::StatusOr<v1::SelectResponse> refused = transport.Await(*bad, absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("99"), absl::string_view::npos) << refused.status();
  auto answered = transport.Await(*good, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->selections_size(), 1);
  EXPECT_TRUE(transport.Close().ok());
}

TEST_F(TransportTest, AServerGoingAwayFailsTheOutstandingRequests) {
  GrpcStreamTransport transport(channel_);
  server_->Shutdown(absl::ToChronoTime(absl::Now()));
  auto id = transport.Submit(Request(7, 0, kSlots - 1));
  if (id.ok()) {
    const absl::StatusCode code =
        transport.Await(*id, absl::Now() + absl::Seconds(30)).status().code();
    // Either the answer raced the shutdown, or the stream ended before it.
    EXPECT_TRUE(code == absl::StatusCode::kOk || code == absl::StatusCode::kUnavailable ||
                code == absl::StatusCode::kCancelled)
        << code;
  } else {
    EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST_F(TransportTest, DeadlinePassedBeforeTheAnswerIsDeadlineExceededAndTheAnswerStaysCollectable) {
  GrpcStreamTransport transport(channel_);
  auto id = transport.Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(id.ok());
  // A deadline already in the past: either the answer is there already or the wait times out.
  auto early = transport.Await(*id, absl::InfinitePast());
  if (!early.ok()) {
    EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(transport.Await(*id, absl::Now() + absl::Seconds(30)).ok());
  }
}

TEST_F(TransportTest, AForgottenRequestIsNotCollectableAndTheStreamGoesOn) {
  GrpcStreamTransport transport(channel_);
  auto id = transport.Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(id.ok());
  transport.Forget(*id);
  EXPECT_EQ(transport.Await(*id, absl::Now() + absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kNotFound);
  transport.Forget(424242);  // unknown: no-op
  auto next = transport.Submit(Request(7, 1, kSlots - 1));
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(transport.Await(*next, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_TRUE(transport.Close().ok());
  EXPECT_TRUE(transport.Close().ok());  // idempotent
}

TEST_F(TransportTest, ARefusalSaysHowManyGroupsTheIndexerApplied) {
  GrpcStreamTransport transport(channel_);
  // Distinct sequences, the second unknown: every check runs first, nothing is applied.
  v1::SelectRequest distinct = Request(7, 0, kSlots - 1);
  *distinct.add_groups() = Request(99, 0, kSlots - 1).groups(0);
  auto id = transport.Submit(distinct);
  ASSERT_TRUE(id.ok());
  absl::Status refused = transport.Await(*id, absl::Now() + absl::Seconds(30)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(refused.GetPayload(kGroupsAppliedPayload).has_value());
  EXPECT_EQ(std::string(*refused.GetPayload(kGroupsAppliedPayload)), "0");
  // One sequence twice at the same layer and position: the groups run in order, the first is
  // applied, the second is refused by the engine (its position is no longer after the last).
  v1::SelectRequest repeated = Request(7, 0, kSlots - 1);
  *repeated.add_groups() = Request(7, 0, kSlots - 1).groups(0);
  id = transport.Submit(repeated);
  ASSERT_TRUE(id.ok());
  refused = transport.Await(*id, absl::Now() + absl::Seconds(30)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(refused.GetPayload(kGroupsAppliedPayload).has_value());
  EXPECT_EQ(std::string(*refused.GetPayload(kGroupsAppliedPayload)), "1");
  EXPECT_TRUE(transport.Close().ok());
}

}  // namespace
}  // namespace dsa
