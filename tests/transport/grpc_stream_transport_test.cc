// Tests of the selection transports, each against its indexer: the gRPC stream (a real in-process
// indexer server on loopback) and the in-process transport (the engine itself). Layers submitted
// ahead and awaited later get the engine's own answers, bit-identical over both; a refused
// request gets the indexer's status and the others go on; a server going away fails what is
// outstanding with the stream's final status; ids, deadlines and closing behave as documented.
#include "transport/grpc_stream_transport.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "transport/in_process_transport.h"

namespace dsa {
namespace {

namespace v1 = dsa::indexer::v1;
constexpr int kH = 4, kD = 16, kK = 32, kLayers = 2, kSlots = 500;

enum class Kind { kGrpcStream, kInProcess };

class TransportTest : public ::testing::TestWithParam<Kind> {
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

  // The transport under test.
  std::unique_ptr<SelectionTransport> MakeTransport() {
    if (GetParam() == Kind::kGrpcStream) return std::make_unique<GrpcStreamTransport>(channel_);
    return std::make_unique<InProcessSelectionTransport>(indexer_.get());
  }

  LayerSelectRequest Request(uint64_t sequence, int layer, int64_t position) {
    LayerSelectRequest request;
    request.num_heads = kH;
    request.head_dim = kD;
    SelectRowGroup& group = request.groups.emplace_back();
    group.sequence_id = sequence;
    group.layer = layer;
    group.first_position = position;
    group.num_rows = 1;
    group.queries = query_;
    group.head_weights = weights_;
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

TEST_P(TransportTest, LayersSubmittedAheadAreAwaitedLaterWithTheEnginesAnswers) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  auto first = transport.Submit(Request(7, 0, kSlots - 1));
  auto second = transport.Submit(Request(7, 1, kSlots - 1));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(*first, *second);
  // Collected out of order, as a later layer may need an earlier full layer's selection.
  for (auto [id, layer] : {std::pair{*second, 1}, std::pair{*first, 0}}) {
    auto response = transport.Await(id, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->groups.size(), 1u);
    const GroupSelection& group = response->groups[0];
    EXPECT_EQ(group.num_rows, 1);
    EXPECT_EQ(group.top_k, kK);
    EXPECT_EQ(group.selections, TwinSelection(layer, kSlots - 1)) << "layer " << layer;
    EXPECT_GT(group.blocks_scored, 0);
    EXPECT_EQ(group.blocks_visible, (kSlots + 63) / 64);
  }
  EXPECT_EQ(transport.Await(*first, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(transport.Await(12345, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(transport.Close().ok());
  EXPECT_EQ(transport.Submit(Request(7, 0, kSlots - 1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_P(TransportTest, ARefusedRequestGetsTheIndexersStatusAndOthersGoOn) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  auto bad = transport.Submit(Request(99, 0, kSlots - 1));  // unknown sequence
  auto good = transport.Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(bad.ok() && good.ok());
  const absl::StatusOr<LayerSelection> refused = transport.Await(*bad, absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("99"), absl::string_view::npos) << refused.status();
  auto answered = transport.Await(*good, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->groups.size(), 1u);
  EXPECT_TRUE(transport.Close().ok());
}

// ended() tells the owner to replace a transport whose connection is gone (an indexer that
// restarted): false while the stream serves, true once the server went away.
TEST_P(TransportTest, EndedTurnsTrueOnceTheServerWentAway) {
  auto transport = MakeTransport();
  auto id = transport->Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(transport->Await(*id, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_FALSE(transport->ended());
  if (GetParam() != Kind::kGrpcStream) return;  // in process: never ends
  server_->Shutdown(absl::ToChronoTime(absl::Now()));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!transport->ended() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(transport->ended());
  EXPECT_EQ(transport->Submit(Request(7, 0, kSlots - 1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_P(TransportTest, DeadlinePassedBeforeTheAnswerIsDeadlineExceededAndTheAnswerStaysCollectable) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  auto id = transport.Submit(Request(7, 0, kSlots - 1));
  ASSERT_TRUE(id.ok());
  // A deadline already in the past: either the answer is there already or the wait times out.
  auto early = transport.Await(*id, absl::InfinitePast());
  if (!early.ok()) {
    EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(transport.Await(*id, absl::Now() + absl::Seconds(30)).ok());
  }
}

TEST_P(TransportTest, AForgottenRequestIsNotCollectableAndTheStreamGoesOn) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
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

TEST_P(TransportTest, ARefusalSaysHowManyGroupsTheIndexerApplied) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  // Distinct sequences, the second unknown: every check runs first, nothing is applied.
  LayerSelectRequest distinct = Request(7, 0, kSlots - 1);
  distinct.groups.push_back(Request(99, 0, kSlots - 1).groups[0]);
  auto id = transport.Submit(distinct);
  ASSERT_TRUE(id.ok());
  absl::Status refused = transport.Await(*id, absl::Now() + absl::Seconds(30)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(refused.GetPayload(kGroupsAppliedPayload).has_value());
  EXPECT_EQ(std::string(*refused.GetPayload(kGroupsAppliedPayload)), "0");
  // One sequence twice at the same layer and position: the groups run in order, the first is
  // applied, the second is refused by the engine (its position is no longer after the last).
  LayerSelectRequest repeated = Request(7, 0, kSlots - 1);
  repeated.groups.push_back(Request(7, 0, kSlots - 1).groups[0]);
  id = transport.Submit(repeated);
  ASSERT_TRUE(id.ok());
  refused = transport.Await(*id, absl::Now() + absl::Seconds(30)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(refused.GetPayload(kGroupsAppliedPayload).has_value());
  EXPECT_EQ(std::string(*refused.GetPayload(kGroupsAppliedPayload)), "1");
  EXPECT_TRUE(transport.Close().ok());
}

TEST_P(TransportTest, NewIndexKeysAndVerifierRowsRoundTripAsTheEngineAnswers) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  // Three verifier rows at kSlots..kSlots+2 with their three new keys on layer 1.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  LayerSelectRequest request = Request(7, 1, kSlots);
  SelectRowGroup& group = request.groups[0];
  group.num_rows = 3;
  group.queries.resize(3 * kH * kD);
  group.head_weights.resize(3 * kH);
  group.new_index_keys.resize(3 * kD);
  for (float& v : group.queries) v = normal(rng);
  for (float& v : group.head_weights) v = std::abs(normal(rng));
  for (float& v : group.new_index_keys) v = normal(rng);
  ASSERT_TRUE(twin_->AppendIndexKeys(7, 1, group.new_index_keys, 3).ok());
  std::vector<IndexerRow> rows;
  rows.reserve(3);
  for (int r = 0; r < 3; ++r) {
    rows.push_back({std::span<const float>(group.queries).subspan(r * kH * kD, kH * kD),
                    std::span<const float>(group.head_weights).subspan(r * kH, kH), kSlots + r});
  }
  auto expected = twin_->Select(7, 1, rows);
  ASSERT_TRUE(expected.ok()) << expected.status();
  auto id = transport.Submit(request);
  ASSERT_TRUE(id.ok());
  auto answer = transport.Await(*id, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->groups.size(), 1u);
  EXPECT_EQ(answer->groups[0].num_rows, 3);
  EXPECT_EQ(answer->groups[0].selections, expected->selections);
  EXPECT_EQ(answer->groups[0].blocks_scored, expected->blocks_scored);
  EXPECT_EQ(*indexer_->NumSlots(7, 1), kSlots + 3);
  EXPECT_TRUE(transport.Close().ok());
}

TEST_P(TransportTest, AShapeThatDiffersFromTheIndexersIsRefused) {
  std::unique_ptr<SelectionTransport> owned = MakeTransport();
  SelectionTransport& transport = *owned;
  LayerSelectRequest request = Request(7, 0, kSlots - 1);
  request.groups[0].head_weights.pop_back();  // [1, H - 1]
  auto id = transport.Submit(request);
  ASSERT_TRUE(id.ok());
  const absl::Status refused = transport.Await(*id, absl::Now() + absl::Seconds(30)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("head_weights"), absl::string_view::npos) << refused;
  EXPECT_TRUE(transport.Close().ok());
}

// An indexer that reads select requests and never answers them: the requests stay outstanding
// until the server goes away, whatever the machine's speed.
class SilentIndexer final : public v1::IndexerService::Service {
 public:
  grpc::Status SelectStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SelectResponse, v1::SelectRequest>* stream) override {
    v1::SelectRequest request;
    while (stream->Read(&request)) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++received_;
      arrived_.notify_all();
    }
    return grpc::Status::OK;
  }

  // Blocks until `count` requests were read (or 30 s passed); whether they were.
  bool WaitReceived(int count) {
    std::unique_lock<std::mutex> lock(mutex_);
    return arrived_.wait_for(lock, std::chrono::seconds(30), [&] { return received_ >= count; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  int received_ = 0;
};

// The connection's end is the answer to every request still outstanding: UNAVAILABLE, with the
// stream's final status (what Close returns), never an answer; later Submits are UNAVAILABLE too.
TEST(GrpcStreamTransportTest, AServerGoingAwayFailsTheOutstandingRequests) {
  SilentIndexer silent;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&silent);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  GrpcStreamTransport transport(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  LayerSelectRequest request;
  request.num_heads = kH;
  request.head_dim = kD;
  SelectRowGroup& group = request.groups.emplace_back();
  group.sequence_id = 7;
  group.num_rows = 1;
  group.first_position = kSlots - 1;
  group.queries.assign(kH * kD, 0.5f);
  group.head_weights.assign(kH, 1.0f);
  auto first = transport.Submit(request);
  auto second = transport.Submit(request);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(silent.WaitReceived(2));  // both on the server, neither answered
  EXPECT_FALSE(transport.ended());
  server->Shutdown(absl::ToChronoTime(absl::Now()));  // cancels the stream at once

  const absl::Status awaited = transport.Await(*first, absl::InfiniteFuture()).status();
  EXPECT_EQ(awaited.code(), absl::StatusCode::kUnavailable) << awaited;
  EXPECT_TRUE(transport.ended());
  const absl::Status second_awaited = transport.Await(*second, absl::InfiniteFuture()).status();
  EXPECT_EQ(second_awaited, awaited);
  // Each failed once: the ids are collected.
  EXPECT_EQ(transport.Await(*first, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  const absl::Status later = transport.Submit(request).status();
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
  EXPECT_NE(later.message().find(awaited.message()), absl::string_view::npos) << later;
  EXPECT_EQ(transport.Close(), awaited);  // the connection's final status
}

// An indexer that hangs: it takes the stream and reads it to the client's WritesDone, but never
// ends it until the test lets it go (a peer alive on the network, stuck in its handler).
class HangingIndexer final : public v1::IndexerService::Service {
 public:
  grpc::Status SelectStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SelectResponse, v1::SelectRequest>* stream) override {
    opened_.Notify();
    v1::SelectRequest request;
    while (stream->Read(&request)) {
    }
    writes_done_.Notify();
    release_.WaitForNotification();
    return grpc::Status::OK;
  }

  absl::Notification& opened() { return opened_; }
  absl::Notification& writes_done() { return writes_done_; }
  // Lets the handler return (once); the server's shutdown waits for it.
  void Release() { release_.Notify(); }

 private:
  absl::Notification opened_, writes_done_, release_;
};

// Against a peer that never ends the stream, Close waits out its grace and then cancels: it
// returns CANCELLED, the grace (not the default one) after it began.
TEST(GrpcStreamTransportTest, CloseCancelsAStreamThePeerDoesNotEndWithinTheGrace) {
  HangingIndexer hanging;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&hanging);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  // Runs before the server's destructor (which waits for the handler), however the test ends.
  const absl::Cleanup release = [&hanging] { hanging.Release(); };
  ASSERT_NE(port, 0);
  constexpr absl::Duration kGrace = absl::Milliseconds(50);
  static_assert(kGrace < GrpcStreamTransport::kDefaultCloseGrace);
  GrpcStreamTransport transport(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()),
      kGrace);
  ASSERT_TRUE(hanging.opened().WaitForNotificationWithTimeout(absl::Seconds(30)));
  const absl::Time begun = absl::Now();
  const absl::Status closed = transport.Close();
  const absl::Duration took = absl::Now() - begun;
  EXPECT_EQ(closed.code(), absl::StatusCode::kCancelled) << closed;
  EXPECT_TRUE(transport.ended());
  // The peer got the WritesDone and still held the stream: the grace ran out, nothing else.
  EXPECT_TRUE(hanging.writes_done().WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_GE(took, kGrace);
  EXPECT_LT(took, GrpcStreamTransport::kDefaultCloseGrace);
  EXPECT_EQ(transport.Close(), closed);  // idempotent
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest,
                         ::testing::Values(Kind::kGrpcStream, Kind::kInProcess),
                         [](const ::testing::TestParamInfo<Kind>& info) {
                           return info.param == Kind::kGrpcStream ? "GrpcStream" : "InProcess";
                         });

}  // namespace
}  // namespace dsa
