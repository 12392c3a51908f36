// Tests of the NCCL data plane on one GPU: the loopback link (a one-rank communicator, self
// send/recv) runs the deployment's code on both sides (NcclSelectionTransport -> wire -> NCCL ->
// NcclSelectionServer -> RunLayerSelect -> back), and its selections equal RunLayerSelect's
// directly and the gRPC stream's for the same steps. Also: refusals keep their status and groups
// applied; a peer that never answers ends in UNAVAILABLE within the timeout (no hang); deadlines,
// Forget and Close; OpenDataPlane's checks, the half-joined communicator aborted. Skips without a
// GPU.
#include "transport/nccl_transport.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/layer_select.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"
#include "transport/grpc_stream_transport.h"
#include "transport/nccl_bootstrap.h"
#include "transport/nccl_comm_impl.h"
#include "transport/nccl_server.h"

namespace dsa {
namespace {

namespace v1 = dsa::indexer::v1;
constexpr int kH = 8, kD = 32, kK = 64, kLayers = 2, kSlots = 1000;

// A handler that blocks until released (an indexer that stops answering).
class Gate {
 public:
  void Release() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }
  void Pass() {
    std::unique_lock<std::mutex> lock(mutex_);
    entered_ = true;
    cv_.wait(lock, [&] { return open_; });
  }
  bool entered() {
    std::lock_guard<std::mutex> lock(mutex_);
    return entered_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false, entered_ = false;
};

LayerSelection EchoSelection(const LayerSelectRequest& request) {
  LayerSelection selection;
  for (const SelectRowGroup& group : request.groups) {
    GroupSelection& answer = selection.groups.emplace_back();
    answer.num_rows = group.num_rows;
    answer.top_k = 4;
    answer.selections.assign(group.num_rows * 4, static_cast<int32_t>(group.first_position));
  }
  return selection;
}

class NcclTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::testing::NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
    IndexerOptions options{.capacity_blocks = 256, .num_heads = kH, .head_dim = kD};
    for (auto* x : {&indexer_, &twin_, &grpc_indexer_}) *x = std::move(*Indexer::Create(options));
    SequenceOptions sequence;
    sequence.num_layers = kLayers;
    sequence.top_k = kK;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    std::vector<float> keys(kSlots * kD);
    for (Indexer* x : All()) {
      ASSERT_TRUE(x->CreateSequence(7, sequence).ok());
      ASSERT_TRUE(x->CreateSequence(8, sequence).ok());
    }
    for (uint64_t seq : {7, 8}) {
      for (int layer = 0; layer < kLayers; ++layer) {
        for (float& v : keys) v = normal(rng);
        for (Indexer* x : All()) ASSERT_TRUE(x->AppendIndexKeys(seq, layer, keys, kSlots).ok());
      }
    }
    auto link = CreateLoopbackNcclLink({.cuda_device = 0});
    ASSERT_TRUE(link.ok()) << link.status();
    link_ = *link;
  }

  std::vector<Indexer*> All() { return {indexer_.get(), twin_.get(), grpc_indexer_.get()}; }

  // One decode step of `sequences` at `layer`: each row at `position` with one new key there.
  LayerSelectRequest Step(std::vector<uint64_t> sequences, int layer, int64_t position,
                          uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    LayerSelectRequest request;
    request.num_heads = kH;
    request.head_dim = kD;
    for (uint64_t sequence : sequences) {
      SelectRowGroup& group = request.groups.emplace_back();
      group.sequence_id = sequence;
      group.layer = layer;
      group.first_position = position;
      group.num_rows = 1;
      group.queries.resize(kH * kD);
      group.head_weights.resize(kH);
      group.new_index_keys.resize(kD);
      for (float& v : group.queries) v = normal(rng);
      for (float& v : group.head_weights) v = std::abs(normal(rng));
      for (float& v : group.new_index_keys) v = normal(rng);
    }
    return request;
  }

  std::unique_ptr<NcclSelectionServer> StartServer(const NcclServerOptions& options = {},
                                                   SequenceOwnerCheck check_owned = nullptr) {
    auto server = NcclSelectionServer::Start(*indexer_, nullptr, link_, options, check_owned);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  std::unique_ptr<Indexer> indexer_, twin_, grpc_indexer_;
  std::shared_ptr<NcclLink> link_;
};

void ExpectSame(const LayerSelection& a, const LayerSelection& b, const std::string& what) {
  ASSERT_EQ(a.groups.size(), b.groups.size()) << what;
  for (size_t g = 0; g < a.groups.size(); ++g) {
    EXPECT_EQ(a.groups[g].num_rows, b.groups[g].num_rows) << what;
    EXPECT_EQ(a.groups[g].top_k, b.groups[g].top_k) << what;
    EXPECT_EQ(a.groups[g].selections, b.groups[g].selections) << what << " group " << g;
    EXPECT_EQ(a.groups[g].blocks_scored, b.groups[g].blocks_scored) << what;
    EXPECT_EQ(a.groups[g].blocks_visible, b.groups[g].blocks_visible) << what;
    EXPECT_EQ(a.groups[g].all_blocks, b.groups[g].all_blocks) << what;
    EXPECT_EQ(a.groups[g].audit_miss_rates, b.groups[g].audit_miss_rates) << what;
  }
}

TEST_F(NcclTransportTest, LoopbackSelectionsEqualRunLayerSelectAndTheGrpcStream) {
  std::unique_ptr<NcclSelectionServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  NcclSelectionTransport nccl(link_, {});
  // The same steps over the gRPC stream, against a third copy of the indexer.
  IndexerServiceImpl service(grpc_indexer_.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  GrpcStreamTransport grpc(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  // Decode steps: both layers submitted before either is awaited (MLI's lag), two sequences per
  // request, the first steps warm-ups, then SPIN-pruned ones.
  for (int step = 0; step < 6; ++step) {
    const int64_t position = kSlots + step;
    std::vector<LayerSelectRequest> requests;
    std::vector<uint64_t> nccl_ids, grpc_ids;
    for (int layer = 0; layer < kLayers; ++layer) {
      requests.push_back(Step({7, 8}, layer, position, 100 * step + layer));
      auto id = nccl.Submit(requests.back());
      ASSERT_TRUE(id.ok()) << id.status();
      nccl_ids.push_back(*id);
      auto grpc_id = grpc.Submit(requests.back());
      ASSERT_TRUE(grpc_id.ok()) << grpc_id.status();
      grpc_ids.push_back(*grpc_id);
    }
    for (int layer = kLayers - 1; layer >= 0; --layer) {  // collected out of order
      auto over_nccl = nccl.Await(nccl_ids[layer], absl::Now() + absl::Seconds(30));
      ASSERT_TRUE(over_nccl.ok()) << over_nccl.status();
      auto over_grpc = grpc.Await(grpc_ids[layer], absl::Now() + absl::Seconds(30));
      ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
      auto direct = RunLayerSelect(*twin_, requests[layer]);
      ASSERT_TRUE(direct.ok()) << direct.status();
      const std::string what = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      ExpectSame(*over_nccl, *direct, what + " (NCCL vs direct)");
      ExpectSame(*over_nccl, *over_grpc, what + " (NCCL vs gRPC)");
      EXPECT_EQ(over_nccl->groups[0].selections.size(), static_cast<size_t>(kK));
    }
  }
  EXPECT_EQ(nccl.Await(12345, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(nccl.Close().ok());
  EXPECT_TRUE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(server->requests_answered(), 6 * kLayers);
  EXPECT_EQ(nccl.Submit(Step({7}, 0, 2 * kSlots, 1)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(grpc.Close().ok());
  grpc_server->Shutdown();
}

TEST_F(NcclTransportTest, ARefusalKeepsItsStatusAndGroupsAppliedAndOthersGoOn) {
  std::unique_ptr<NcclSelectionServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  NcclSelectionTransport nccl(link_, {});
  auto bad = nccl.Submit(Step({99}, 0, kSlots, 1));  // unknown sequence
  // Two groups of one sequence and layer, one with new keys: refused as RunLayerSelect refuses it
  // directly (code and groups applied).
  LayerSelectRequest partial = Step({7}, 0, kSlots, 2);
  LayerSelectRequest second = Step({7}, 1, kSlots, 3);
  partial.groups.push_back(second.groups[0]);
  partial.groups.back().layer = 0;
  partial.groups.back().new_index_keys.clear();
  auto applied = nccl.Submit(partial);
  auto good = nccl.Submit(Step({8}, 0, kSlots, 4));
  ASSERT_TRUE(bad.ok() && applied.ok() && good.ok());
  const absl::StatusOr<LayerSelection> refused = nccl.Await(*bad, absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("99"), std::string::npos) << refused.status();
  EXPECT_EQ(refused.status().GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "0");
  const absl::StatusOr<LayerSelection> half = nccl.Await(*applied, absl::InfiniteFuture());
  ASSERT_FALSE(half.ok());
  int twin_applied = -1;
  const absl::Status direct = RunLayerSelect(*twin_, partial, nullptr, &twin_applied).status();
  EXPECT_EQ(half.status().code(), direct.code()) << half.status() << " vs " << direct;
  EXPECT_EQ(half.status().GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()),
            std::to_string(twin_applied));
  auto answered = nccl.Await(*good, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->groups.size(), 1u);
  // A request the wire cannot carry is refused at Submit, nothing sent.
  LayerSelectRequest misshapen = Step({7}, 1, kSlots, 5);
  misshapen.groups[0].queries.pop_back();
  EXPECT_EQ(nccl.Submit(misshapen).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(nccl.Close().ok());
  EXPECT_TRUE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(NcclTransportTest, DeadlinesForgetAndOrder) {
  // The first request's answer waits at the gate until the test opens it.
  Gate first_answer;
  std::atomic<bool> gated{true};
  auto server = NcclSelectionServer::StartWithHandler(
      [&](const LayerSelectRequest& request, int*) {
        if (gated.exchange(false)) first_answer.Pass();
        return absl::StatusOr<LayerSelection>(EchoSelection(request));
      },
      link_, {});
  ASSERT_TRUE(server.ok()) << server.status();
  NcclSelectionTransport nccl(link_, {.max_outstanding = 4});
  struct OpenAtEnd {  // a failed assertion must not leave the server's thread at the gate
    Gate& gate;
    ~OpenAtEnd() { gate.Release(); }
  } open_at_end{first_answer};
  auto slow = nccl.Submit(Step({7}, 0, 11, 1));
  ASSERT_TRUE(slow.ok());
  // The caller's deadline: DEADLINE_EXCEEDED, the request stays awaitable.
  auto early = nccl.Await(*slow, absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  first_answer.Release();
  auto late = nccl.Await(*slow, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->groups[0].selections[0], 11);
  // Forgotten requests are still received in order; the others get their own answers.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = nccl.Submit(Step({7}, 0, 100 + i, i));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  EXPECT_EQ(nccl.Submit(Step({7}, 0, 200, 9)).status().code(),
            absl::StatusCode::kResourceExhausted);  // max_outstanding
  nccl.Forget(ids[0]);
  nccl.Forget(ids[2]);
  nccl.Forget(777);  // unknown: no-op
  EXPECT_EQ(nccl.Await(ids[0], absl::Now()).status().code(), absl::StatusCode::kNotFound);
  for (int i : {3, 1}) {
    auto answer = nccl.Await(ids[i], absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->groups[0].selections[0], 100 + i);
  }
  // The forgotten ones' slots come back: four more fit.
  for (int i = 0; i < 4; ++i) {
    auto id = nccl.Submit(Step({7}, 0, 300 + i, i));
    ASSERT_TRUE(id.ok()) << id.status();
    auto answer = nccl.Await(*id, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->groups[0].selections[0], 300 + i);
  }
  EXPECT_TRUE(nccl.Close().ok());
  EXPECT_TRUE(nccl.Close().ok());  // idempotent
  EXPECT_TRUE((*server)->Wait(absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(NcclTransportTest, AnswersThatArrivedStayAwaitableAfterClose) {
  std::unique_ptr<NcclSelectionServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  NcclSelectionTransport nccl(link_, {});
  auto first = nccl.Submit(Step({7}, 0, kSlots, 1));
  auto second = nccl.Submit(Step({7}, 1, kSlots, 2));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(nccl.Close().ok());
  for (uint64_t id : {*first, *second}) {
    auto answer = nccl.Await(id, absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->groups[0].top_k, kK);
  }
  EXPECT_TRUE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(NcclTransportTest, AnIndexerThatStopsAnsweringEndsInUnavailableWithinTheTimeout) {
  Gate gate;
  auto server = NcclSelectionServer::StartWithHandler(
      [&](const LayerSelectRequest& request, int*) {
        gate.Pass();
        return absl::StatusOr<LayerSelection>(EchoSelection(request));
      },
      link_, {});
  ASSERT_TRUE(server.ok()) << server.status();
  NcclSelectionTransport nccl(
      link_, {.peer_timeout = absl::Seconds(1), .close_timeout = absl::Milliseconds(500)});
  auto stuck = nccl.Submit(Step({7}, 0, 1, 1));
  auto behind = nccl.Submit(Step({7}, 0, 2, 2));
  ASSERT_TRUE(stuck.ok() && behind.ok());
  EXPECT_EQ(nccl.Await(*stuck, absl::Now() + absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const absl::Time start = absl::Now();
  auto lost = nccl.Await(*stuck, absl::InfiniteFuture());
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
  EXPECT_NE(lost.status().message().find("peer_timeout"), std::string::npos) << lost.status();
  EXPECT_LT(waited, absl::Seconds(3));
  // Every outstanding request fails the same way; nothing more is accepted.
  EXPECT_EQ(nccl.Await(*behind, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(nccl.Submit(Step({7}, 0, 3, 3)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(gate.entered());
  gate.Release();  // the indexer wakes up to an aborted link and ends
  const absl::Status ended = (*server)->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  const absl::Time close_start = absl::Now();
  EXPECT_EQ(nccl.Close().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - close_start, absl::Seconds(2));
}

TEST_F(NcclTransportTest, NoIndexerAtAllEndsInUnavailableAndCloseIsBounded) {
  // Nobody serves the indexer endpoint: the request never leaves.
  NcclSelectionTransport nccl(
      link_, {.peer_timeout = absl::Milliseconds(500), .close_timeout = absl::Milliseconds(300)});
  auto id = nccl.Submit(Step({7}, 0, 1, 1));
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  EXPECT_EQ(nccl.Await(*id, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(nccl.Close().code(), absl::StatusCode::kUnavailable);
}

TEST_F(NcclTransportTest, CloseWithAnUnansweredRequestIsBounded) {
  Gate gate;
  auto server = NcclSelectionServer::StartWithHandler(
      [&](const LayerSelectRequest& request, int*) {
        gate.Pass();
        return absl::StatusOr<LayerSelection>(EchoSelection(request));
      },
      link_, {});
  ASSERT_TRUE(server.ok());
  NcclSelectionTransport nccl(link_, {.close_timeout = absl::Milliseconds(300)});
  auto id = nccl.Submit(Step({7}, 0, 1, 1));
  ASSERT_TRUE(id.ok());
  const absl::Time start = absl::Now();
  const absl::Status closed = nccl.Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(nccl.Await(*id, absl::Now()).status().code(), absl::StatusCode::kUnavailable);
  gate.Release();
  (*server)->Stop();
}

TEST_F(NcclTransportTest, StoppingTheServerFailsTheAttentionSide) {
  std::unique_ptr<NcclSelectionServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  NcclSelectionTransport nccl(link_, {});
  auto id = nccl.Submit(Step({7}, 0, kSlots, 1));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(nccl.Await(*id, absl::Now() + absl::Seconds(30)).ok());
  server->Stop();  // idle: the link is aborted
  EXPECT_EQ(server->Wait(absl::Now()).code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(server->serving());
  EXPECT_EQ(nccl.Submit(Step({7}, 1, kSlots, 2)).status().code(), absl::StatusCode::kUnavailable);
  server->Stop();  // idempotent
}

// A data plane opened by a verified caller selects only for that caller's sequences: a request
// naming another's is PERMISSION_DENIED with nothing applied (the same request without it then
// runs at the same position, which it could not had the refused one appended its keys).
TEST_F(NcclTransportTest, TheServerRefusesAnotherCallersSequenceAndAppliesNothing) {
  std::unique_ptr<NcclSelectionServer> server = StartServer({}, [](uint64_t sequence_id) {
    return sequence_id == 8 ? absl::PermissionDeniedError("sequence 8 belongs to another caller")
                            : absl::OkStatus();
  });
  ASSERT_NE(server, nullptr);
  NcclSelectionTransport nccl(link_, {});
  auto refused_id = nccl.Submit(Step({7, 8}, 0, kSlots, 1));
  ASSERT_TRUE(refused_id.ok()) << refused_id.status();
  const absl::StatusOr<LayerSelection> refused = nccl.Await(*refused_id, absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("sequence 8"), std::string::npos) << refused.status();
  EXPECT_EQ(refused.status().GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "0");
  auto own = nccl.Submit(Step({7}, 0, kSlots, 1));
  ASSERT_TRUE(own.ok());
  const absl::StatusOr<LayerSelection> answered = nccl.Await(*own, absl::InfiniteFuture());
  ASSERT_TRUE(answered.ok()) << answered.status();
  const absl::StatusOr<LayerSelection> direct = RunLayerSelect(*twin_, Step({7}, 0, kSlots, 1));
  ASSERT_TRUE(direct.ok()) << direct.status();
  ExpectSame(*direct, *answered, "sequence 7 after the refusal");
  EXPECT_TRUE(nccl.Close().ok());
  EXPECT_TRUE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
}

// NcclDataPlanes (links joined as loopbacks: one GPU cannot hold both ranks): each data plane
// holds its selects to the caller that opened it, and another caller cannot replace an attention
// worker's data plane by opening one under its name; the same caller can (the worker restarted).
TEST_F(NcclTransportTest, DataPlanesBelongToTheCallerThatOpenedThem) {
  std::vector<std::shared_ptr<NcclLink>> joined;
  NcclDataPlaneOptions options;
  options.join = [&](const ncclUniqueId&) -> absl::StatusOr<std::shared_ptr<NcclLink>> {
    auto link = CreateLoopbackNcclLink({.cuda_device = 0});
    if (link.ok()) joined.push_back(*link);
    return link;
  };
  NcclDataPlanes planes(*indexer_, nullptr, options);
  const WireLimits limits;
  v1::OpenDataPlaneRequest request;
  request.set_nccl_unique_id(std::string(NCCL_UNIQUE_ID_BYTES, '\0'));
  request.set_num_ranks(2);
  request.set_indexer_rank(1);
  request.set_num_heads(kH);
  request.set_head_dim(kD);
  request.set_max_top_k(limits.max_top_k);
  request.set_max_message_bytes(limits.max_message_bytes);
  request.set_attention_worker("attention-0");
  auto caller = [](const std::string& identity, uint64_t theirs) {
    DataPlaneCaller c;
    c.identity = identity;
    c.check_owned = [theirs](uint64_t sequence_id) {
      return sequence_id == theirs ? absl::PermissionDeniedError(absl::StrCat(
                                         "sequence ", sequence_id, " belongs to another caller"))
                                   : absl::OkStatus();
    };
    return c;
  };
  v1::OpenDataPlaneResponse response;
  ASSERT_TRUE(planes.Open(request, caller("attention-a", 8), &response).ok());
  ASSERT_EQ(joined.size(), 1u);
  NcclSelectionTransport first(joined[0], {.limits = limits});
  auto refused = first.Submit(Step({8}, 0, kSlots, 1));
  auto own = first.Submit(Step({7}, 0, kSlots, 1));
  ASSERT_TRUE(refused.ok() && own.ok());
  EXPECT_EQ(first.Await(*refused, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(first.Await(*own, absl::InfiniteFuture()).ok());

  // attention-b claims the name: refused before anything is joined, the first plane serves on.
  const absl::Status taken = planes.Open(request, caller("attention-b", 7), &response);
  EXPECT_EQ(taken.code(), absl::StatusCode::kPermissionDenied) << taken;
  EXPECT_NE(taken.message().find("attention-0"), std::string::npos) << taken;
  EXPECT_EQ(joined.size(), 1u);
  EXPECT_EQ(planes.num_serving(), 1);
  auto still = first.Submit(Step({7}, 1, kSlots, 2));
  ASSERT_TRUE(still.ok());
  EXPECT_TRUE(first.Await(*still, absl::InfiniteFuture()).ok());
  // Under another name attention-b gets its own plane, held to its own sequences.
  request.set_attention_worker("attention-1");
  ASSERT_TRUE(planes.Open(request, caller("attention-b", 7), &response).ok());
  ASSERT_EQ(joined.size(), 2u);
  EXPECT_EQ(planes.num_serving(), 2);
  NcclSelectionTransport second(joined[1], {.limits = limits});
  auto not_theirs = second.Submit(Step({7}, 1, kSlots, 3));
  ASSERT_TRUE(not_theirs.ok());
  EXPECT_EQ(second.Await(*not_theirs, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(second.Close().ok());
  // Its server ends once it has read the close message.
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10);
       planes.num_serving() > 1 && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(planes.num_serving(), 1);
  // attention-b still cannot take attention-0, served or not: the name stays attention-a's.
  request.set_attention_worker("attention-0");
  EXPECT_EQ(planes.Open(request, caller("attention-b", 7), &response).code(),
            absl::StatusCode::kPermissionDenied);
  // attention-a opens attention-0 again (it restarted): its old plane is stopped.
  ASSERT_TRUE(planes.Open(request, caller("attention-a", 8), &response).ok());
  EXPECT_EQ(joined.size(), 3u);
  EXPECT_EQ(planes.num_serving(), 1);
  EXPECT_EQ(first.Submit(Step({7}, 1, kSlots, 4)).status().code(), absl::StatusCode::kUnavailable);
}

// OpenDataPlane over a real gRPC server: the checks come before NCCL, and a refused bootstrap
// aborts the attention side's half-joined communicator (the call returns, nothing hangs).
TEST_F(NcclTransportTest, OpenDataPlaneRefusesMismatchedShapesWithoutHanging) {
  IndexerServiceImpl service(indexer_.get());
  NcclDataPlanes planes(*indexer_, nullptr, {});
  service.SetDataPlaneOpener(planes.Opener());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  auto stub = v1::IndexerService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  NcclConnectOptions options;
  options.num_heads = kH;
  options.head_dim = kD + 1;
  options.connect_timeout = absl::Seconds(20);
  const absl::Time start = absl::Now();
  auto transport = ConnectNcclSelectionTransport(*stub, options);
  EXPECT_EQ(transport.status().code(), absl::StatusCode::kInvalidArgument) << transport.status();
  EXPECT_NE(transport.status().message().find("head_dim"), std::string::npos) << transport.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  options.head_dim = kD;
  options.num_heads = kH * 2;
  transport = ConnectNcclSelectionTransport(*stub, options);
  EXPECT_NE(transport.status().message().find("num_heads"), std::string::npos)
      << transport.status();
  // Direct calls: a short id, wrong ranks.
  v1::OpenDataPlaneRequest request;
  request.set_nccl_unique_id("short");
  request.set_num_ranks(2);
  request.set_indexer_rank(1);
  request.set_num_heads(kH);
  request.set_head_dim(kD);
  request.set_max_top_k(kK);
  request.set_max_message_bytes(1 << 20);
  v1::OpenDataPlaneResponse response;
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub->OpenDataPlane(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  request.set_nccl_unique_id(std::string(NCCL_UNIQUE_ID_BYTES, '\0'));
  request.set_num_ranks(3);
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub->OpenDataPlane(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(planes.num_serving(), 0);
  grpc_server->Shutdown();
}

// A two-rank communicator whose peer never joins: WaitReady ends in UNAVAILABLE at its deadline
// and the half-initialized communicator is aborted.
TEST_F(NcclTransportTest, APeerThatNeverJoinsEndsInUnavailable) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto link = StartTwoRankNcclLink(id, 0, {.cuda_device = 0});
  ASSERT_TRUE(link.ok()) << link.status();
  const absl::Time start = absl::Now();
  const absl::Status ready = (*link)->WaitReady(absl::Now() + absl::Seconds(1));
  EXPECT_EQ(ready.code(), absl::StatusCode::kUnavailable) << ready;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  NcclSelectionTransport nccl(*link, {});
  EXPECT_EQ(nccl.Submit(Step({7}, 0, 1, 1)).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace dsa
