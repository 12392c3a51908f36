// Bad input and faults against the real binaries on loopback (docs/reliability.md, "Bad input and
// faults"): each of dsa-indexer, dsa-attention and dsa-coordinator started as a process on port 0.
// - malformed requests (wrong dtype or shape, NaN, unknown ids, a context beyond capacity, a
//   message over the size limit) get their precise status and the cluster goes on serving;
// - a client that stops reading its Generate stream is held to a bounded backlog and does not slow
//   the other requests (their latency against a baseline measured before it stopped);
// - SIGTERM with a Generate stream open: readiness NOT_SERVING while draining, new requests
//   UNAVAILABLE, the process exits 0 within the drain delay plus the grace period.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/testing/server_process.h"

namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;
using Clock = std::chrono::steady_clock;
using dsa::testing::Process;

constexpr int kHeads = 8;
constexpr int kHeadDim = 32;
constexpr int64_t kCapacityBlocks = 2048;

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// One small cluster of real processes: an indexer, an attention worker and a coordinator.
class FaultsTest : public ::testing::Test {
 protected:
  void StartCluster(const std::vector<std::string>& coordinator_flags = {}) {
    indexer_ = dsa::testing::StartServer(
        DSA_INDEXER_BINARY, {"--capacity-blocks", std::to_string(kCapacityBlocks), "--num-heads",
                             std::to_string(kHeads), "--head-dim", std::to_string(kHeadDim)});
    ASSERT_FALSE(indexer_.address.empty());
    attention_ = dsa::testing::StartServer(DSA_ATTENTION_BINARY,
                                           {"--num-heads", std::to_string(kHeads), "--head-dim",
                                            std::to_string(kHeadDim), "--layer-pattern", "FSFS"});
    ASSERT_FALSE(attention_.address.empty());
    std::vector<std::string> flags = {"--indexer",        indexer_.address, "--attention",
                                      attention_.address, "--top-k",        "256"};
    flags.insert(flags.end(), coordinator_flags.begin(), coordinator_flags.end());
    coordinator_ = dsa::testing::StartServer(DSA_COORDINATOR_BINARY, flags);
    ASSERT_FALSE(coordinator_.address.empty());
    coordinator_stub_ = cv1::CoordinatorService::NewStub(Channel(coordinator_.address));
  }

  void TearDown() override {
    coordinator_stub_.reset();
    for (Process* p : {&coordinator_, &attention_, &indexer_}) {
      if (p->pid > 0) {
        kill(p->pid, SIGTERM);
        EXPECT_EQ(dsa::testing::WaitExit(p->pid, std::chrono::seconds(20)), 0);
        p->pid = -1;
      }
    }
  }

  static cv1::GenerateRequest Request(const std::string& id, int64_t context, int64_t new_tokens,
                                      int draft = 0) {
    cv1::GenerateRequest request;
    request.set_request_id(id);
    request.set_context_length(context);
    request.set_max_new_tokens(new_tokens);
    request.set_draft_length(draft);
    return request;
  }

  // Runs a Generate to its end: the final status and the tokens streamed.
  grpc::Status Generate(const cv1::GenerateRequest& request, int64_t* tokens = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = coordinator_stub_->Generate(&context, request);
    cv1::GenerateEvent event;
    int64_t count = 0;
    while (reader->Read(&event)) {
      if (event.has_tokens()) count += event.tokens().count();
    }
    if (tokens != nullptr) *tokens = count;
    return reader->Finish();
  }

  Process indexer_, attention_, coordinator_;
  std::unique_ptr<cv1::CoordinatorService::Stub> coordinator_stub_;
};

TEST_F(FaultsTest, MalformedRequestsGetThePreciseStatusAndTheClusterKeepsServing) {
  StartCluster();
  // Coordinator.
  EXPECT_EQ(Generate(Request("", 100, 4)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Generate(Request("a", 100, 0)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Generate(Request("a", 0, 4)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Generate(Request("a", 100, 4, 5)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  cv1::GenerateRequest too_many_ids = Request("a", 100, 4);
  too_many_ids.add_prefix_block_ids(1);
  too_many_ids.add_prefix_block_ids(2);
  EXPECT_EQ(Generate(too_many_ids).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  cv1::GenerateRequest bad_rho = Request("a", 100, 4);
  bad_rho.mutable_overrides()->set_target_block_sparsity(std::nan(""));
  EXPECT_EQ(Generate(bad_rho).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Beyond the index-key cache: 2 full layers x 64 slots a block.
  const grpc::Status huge = Generate(Request("huge", kCapacityBlocks * 64, 4));
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << huge.error_message();
  // Over the 4 MiB message limit: 1.5M tokens of 3 varint bytes each.
  cv1::GenerateRequest big;
  big.set_request_id("big");
  big.set_max_new_tokens(1);
  for (int i = 0; i < 1500000; ++i) big.mutable_context_tokens()->add_tokens(100000);
  EXPECT_EQ(Generate(big).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  {
    grpc::ClientContext context;
    cv1::AbortRequest request;
    request.set_request_id("nobody");
    cv1::AbortResponse response;
    EXPECT_EQ(coordinator_stub_->Abort(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  // Indexer, directly: a sequence of our own (an id far from the coordinator's).
  auto indexer = iv1::IndexerService::NewStub(Channel(indexer_.address));
  constexpr uint64_t kOwnId = uint64_t{1} << 62;
  {
    grpc::ClientContext context;
    iv1::CreateSequenceRequest request;
    request.set_sequence_id(kOwnId);
    request.set_num_layers(1);
    request.set_top_k(64);
    iv1::CreateSequenceResponse response;
    ASSERT_TRUE(indexer->CreateSequence(&context, request, &response).ok());
  }
  {
    grpc::ClientContext context;
    iv1::AppendIndexKeysResponse response;
    auto writer = indexer->AppendIndexKeys(&context, &response);
    iv1::AppendIndexKeysRequest chunk;
    chunk.set_sequence_id(kOwnId);
    const std::vector<float> keys(static_cast<size_t>(100) * kHeadDim, 0.25f);
    const int64_t shape[] = {100, kHeadDim};
    dsa::EncodeFloatTensor(keys, shape, chunk.mutable_keys());
    ASSERT_TRUE(writer->Write(chunk));
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  auto select = [&](const iv1::RowGroup& group) {
    grpc::ClientContext context;
    iv1::SelectRequest request;
    *request.add_groups() = group;
    iv1::SelectResponse response;
    return indexer->Select(&context, request, &response);
  };
  iv1::RowGroup good;
  good.set_sequence_id(kOwnId);
  good.set_first_position(99);
  const std::vector<float> query(static_cast<size_t>(kHeads) * kHeadDim, 0.5f);
  const int64_t query_shape[] = {1, kHeads, kHeadDim};
  dsa::EncodeFloatTensor(query, query_shape, good.mutable_queries());
  std::vector<float> weights(kHeads, 0.1f);
  const int64_t weight_shape[] = {1, kHeads};
  dsa::EncodeFloatTensor(weights, weight_shape, good.mutable_head_weights());
  iv1::RowGroup wrong_dtype = good;
  wrong_dtype.mutable_queries()->set_dtype(dsa::common::v1::DTYPE_INT32);
  EXPECT_EQ(select(wrong_dtype).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  iv1::RowGroup wrong_shape = good;
  wrong_shape.mutable_queries()->set_shape(2, kHeadDim + 1);
  EXPECT_EQ(select(wrong_shape).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  iv1::RowGroup nan_weights = good;
  weights[3] = std::nanf("");
  dsa::EncodeFloatTensor(weights, weight_shape, nan_weights.mutable_head_weights());
  EXPECT_EQ(select(nan_weights).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  iv1::RowGroup unknown = good;
  unknown.set_sequence_id(kOwnId + 1);
  EXPECT_EQ(select(unknown).error_code(), grpc::StatusCode::NOT_FOUND);
  iv1::RowGroup beyond = good;
  beyond.set_first_position(100);
  EXPECT_EQ(select(beyond).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(select(good).ok());  // the refused ones changed nothing: 99 is still selectable

  // Attention worker, directly.
  auto attention = av1::AttentionService::NewStub(Channel(attention_.address));
  {
    grpc::ClientContext context;
    av1::DecodeStepRequest request;
    av1::SequenceStep* step = request.add_sequences();
    step->set_sequence_id(kOwnId + 7);
    step->set_rows(1);
    av1::DecodeStepResponse response;
    EXPECT_EQ(attention->DecodeStep(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext context;
    av1::DecodeStepRequest request;
    request.add_sequences()->set_sequence_id(kOwnId + 7);  // rows 0
    av1::DecodeStepResponse response;
    EXPECT_EQ(attention->DecodeStep(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext context;
    av1::PrefillRequest request;
    request.set_sequence_id(kOwnId + 8);
    request.set_context_length(100);
    request.set_indexer_worker("127.0.0.1:1");  // nobody listens there
    request.mutable_settings()->set_top_k(64);
    av1::PrefillResponse response;
    EXPECT_EQ(attention->Prefill(&context, request, &response).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }

  // After all that, requests are served in full, speculative ones included.
  int64_t tokens = 0;
  ASSERT_TRUE(Generate(Request("fine", 3000, 12), &tokens).ok());
  EXPECT_EQ(tokens, 12);
  ASSERT_TRUE(Generate(Request("spec", 3000, 12, 3), &tokens).ok());
  EXPECT_EQ(tokens, 12);
}

TEST_F(FaultsTest, AClientThatStopsReadingHasABoundedBacklogAndDoesNotSlowOthers) {
  StartCluster();
  // Two endless requests decoded in the same batches: "fast" is read all along, "slow" stops
  // being read. If the coordinator kept decoding "slow" into an unbounded backlog, its stream
  // would hold every position "fast" reached, ready to read; with a bounded backlog "slow" pauses,
  // and catching up means decoding again, one token a step, as "fast" does in the same steps. So
  // what "slow" reads while catching up, less what "fast" gains meanwhile, is what was queued for
  // it (in the coordinator and gRPC's buffers): judged against what it missed, not against time.
  grpc::ChannelArguments args;  // small HTTP/2 receive window, no BDP probing: gRPC buffers little
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8192);
  auto slow_stub = cv1::CoordinatorService::NewStub(
      grpc::CreateCustomChannel(coordinator_.address, grpc::InsecureChannelCredentials(), args));
  // Long enough to outlast the test; both fit the index-key cache with room for the others.
  constexpr int64_t kLong = 30000;
  std::atomic<int64_t> fast_position{-1};
  grpc::ClientContext fast_context;
  auto fast = coordinator_stub_->Generate(&fast_context, Request("fast", 256, kLong));
  std::thread fast_reader([&] {
    cv1::GenerateEvent e;
    while (fast->Read(&e)) {
      if (e.has_tokens()) fast_position = e.tokens().first_position() + e.tokens().count();
    }
  });
  // The others' latency: per request of 100 tokens, its seconds from the first token to the last,
  // and the part of them spent outside its decode steps (less Tokens.step_seconds): between steps
  // the coordinator only collects the batch and hands out events, so a stalled reader that held
  // the others would show there, 100 times a step's delay, while a loaded machine slows the steps
  // themselves. Each figure is the median of three requests; the baseline is measured now, while
  // "fast" decodes beside them and no reader has stalled.
  constexpr int64_t kOtherTokens = 100;
  struct Latency {
    double seconds = 0;        // first token to last
    double between_steps = 0;  // of those, outside the decode steps
  };
  const auto median_latency = [&](const std::string& name) -> Latency {
    std::vector<double> seconds, between_steps;
    for (int i = 0; i < 3; ++i) {
      const std::string id = name + "-" + std::to_string(i);
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      auto reader = coordinator_stub_->Generate(&context, Request(id, 256, kOtherTokens));
      cv1::GenerateEvent e;
      int64_t tokens = 0;
      Clock::time_point first, last;
      double step_seconds = 0;  // of the steps after the first token's
      while (reader->Read(&e)) {
        if (!e.has_tokens()) continue;
        last = Clock::now();
        if (tokens == 0) first = last;
        if (tokens > 0) step_seconds += e.tokens().step_seconds();
        tokens += e.tokens().count();
      }
      const grpc::Status status = reader->Finish();
      EXPECT_TRUE(status.ok()) << id << ": " << status.error_message();
      EXPECT_EQ(tokens, kOtherTokens) << id;
      seconds.push_back(std::chrono::duration<double>(last - first).count());
      between_steps.push_back(seconds.back() - step_seconds);
    }
    std::sort(seconds.begin(), seconds.end());
    std::sort(between_steps.begin(), between_steps.end());
    std::printf("backlog: %s requests: %.3f s median (%.3f s between steps)\n", name.c_str(),
                seconds[1], between_steps[1]);
    return {seconds[1], between_steps[1]};
  };
  const Latency baseline = median_latency("baseline");
  grpc::ClientContext slow_context;
  // Whatever happens below, end both streams and the reader thread.
  struct Cleanup {
    std::function<void()> run;
    ~Cleanup() { run(); }
  } cleanup{[&] {
    fast_context.TryCancel();
    slow_context.TryCancel();
    fast_reader.join();
  }};
  auto slow = slow_stub->Generate(&slow_context, Request("slow", 256, kLong));
  cv1::GenerateEvent event;
  ASSERT_TRUE(slow->Read(&event));
  ASSERT_TRUE(event.has_admitted());
  ASSERT_TRUE(slow->Read(&event));
  ASSERT_TRUE(event.has_tokens());
  const auto pause_start = Clock::now();
  const int64_t fast_start = fast_position;
  const int64_t slow_start = event.tokens().first_position() + event.tokens().count();

  // While "slow" is not read, other requests complete about as fast as the baseline. Generous
  // bounds, for a loaded machine: the whole, 5x the baseline and 2 s more (a reader that held
  // every step to its stall timeout takes 60 s); between the steps, 3x and 0.25 s more (the
  // baseline's is a few ms; a stalled reader that held each step 5 ms adds 0.5 s).
  const Latency others = median_latency("other");
  EXPECT_LT(others.seconds, 5 * baseline.seconds + 2.0)
      << "the others took " << others.seconds << " s beside the stalled reader, "
      << baseline.seconds << " s before it stalled";
  EXPECT_LT(others.between_steps, 3 * baseline.between_steps + 0.25)
      << "the others spent " << others.between_steps << " s between their steps beside the "
      << "stalled reader, " << baseline.between_steps << " s before it stalled";

  // The pause lasts at least 3 s and until "fast" has decoded 1,000 more tokens, however slowly
  // the machine decodes (a loaded or sanitized build), so that what "slow" missed dwarfs the
  // transport's buffers (a few hundred events with the window above).
  constexpr int64_t kPauseTokens = 1000;
  const auto pause_bound = pause_start + std::chrono::seconds(240);
  while (Clock::now() < pause_start + std::chrono::seconds(3) ||
         (fast_position - fast_start <= kPauseTokens && Clock::now() < pause_bound)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double pause = std::chrono::duration<double>(Clock::now() - pause_start).count();
  const int64_t fast_end = fast_position;
  ASSERT_GT(fast_end - fast_start, kPauseTokens) << "decoding too slow to judge the backlog";

  // Catch "slow" up to where "fast" was at the end of the pause.
  const auto catchup_start = Clock::now();
  int64_t slow_position = slow_start;
  int64_t events = 0;
  while (slow_position < fast_end && slow->Read(&event)) {
    ASSERT_TRUE(event.has_tokens());
    slow_position = event.tokens().first_position() + event.tokens().count();
    ++events;
  }
  const double catchup = std::chrono::duration<double>(Clock::now() - catchup_start).count();
  const int64_t fast_gained = fast_position - fast_end;
  EXPECT_GE(slow_position, fast_end);
  const int64_t missed = fast_end - slow_start;
  const int64_t queued = (slow_position - slow_start) - fast_gained;
  std::printf(
      "backlog: slow missed %lld tokens in a %.2f s pause; read %lld in %.2f s while fast "
      "gained %lld: %lld were queued\n",
      static_cast<long long>(missed), pause, static_cast<long long>(slow_position - slow_start),
      catchup, static_cast<long long>(fast_gained), static_cast<long long>(queued));
  // Unbounded, nearly all of it was queued (and "fast" gained ~0 while it was read).
  EXPECT_LT(queued, missed / 2) << "slow read " << slow_position - slow_start << " tokens ("
                                << events << " events) in " << catchup << " s while fast gained "
                                << fast_gained << ", after missing " << missed << " in a " << pause
                                << " s pause: " << queued << " were queued for it";
}

TEST_F(FaultsTest, AClientThatStallsPastTheStallTimeoutIsEndedAndItsSequenceFreed) {
  StartCluster({"--stall-timeout-ms", "1000"});
  grpc::ChannelArguments args;  // small HTTP/2 receive window, no BDP probing
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8192);
  auto stub = cv1::CoordinatorService::NewStub(
      grpc::CreateCustomChannel(coordinator_.address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stalled = stub->Generate(&context, Request("stalled", 256, 30000));
  cv1::GenerateEvent event;
  ASSERT_TRUE(stalled->Read(&event));
  ASSERT_TRUE(event.has_admitted());
  // Not read from here on. Within a few seconds the coordinator ends it and frees its sequence.
  auto load = [&] {
    grpc::ClientContext c;
    cv1::GetLoadResponse response;
    EXPECT_TRUE(coordinator_stub_->GetLoad(&c, cv1::GetLoadRequest(), &response).ok());
    return response;
  };
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (load().running() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(load().running(), 0) << "the stalled request still holds its sequence";
  // Its stream ends CANCELLED; the cluster serves on.
  while (stalled->Read(&event)) {
  }
  EXPECT_EQ(stalled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  int64_t tokens = 0;
  ASSERT_TRUE(Generate(Request("after", 256, 20), &tokens).ok());
  EXPECT_EQ(tokens, 20);
}

TEST_F(FaultsTest, SigtermWithAnOpenStreamDrainsAndExitsWithinTheGrace) {
  StartCluster({"--drain-delay-ms", "800", "--shutdown-grace-ms", "1500"});
  grpc::ClientContext context;
  auto open = coordinator_stub_->Generate(&context, Request("long", 512, 30000));
  cv1::GenerateEvent event;
  ASSERT_TRUE(open->Read(&event));
  ASSERT_TRUE(open->Read(&event));
  ASSERT_TRUE(event.has_tokens());
  auto channel = Channel(coordinator_.address);
  ASSERT_EQ(dsa::testing::HealthStatus(channel, "readiness"), 1);
  const auto signalled = Clock::now();
  ASSERT_EQ(kill(coordinator_.pid, SIGTERM), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // Draining: not ready, alive, and no new work taken.
  EXPECT_EQ(dsa::testing::HealthStatus(channel, "readiness"), 2);
  EXPECT_EQ(dsa::testing::HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(Generate(Request("late", 256, 4)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The open stream ends (finished or cut at the grace), and the process exits 0 in time.
  while (open->Read(&event)) {
  }
  const grpc::Status status = open->Finish();
  EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  const int exit_code = dsa::testing::WaitExit(coordinator_.pid, std::chrono::seconds(10));
  const double seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
  coordinator_.pid = -1;
  EXPECT_EQ(exit_code, 0);
  EXPECT_LT(seconds, 0.8 + 1.5 + 1.5) << "drain delay 0.8 s + grace 1.5 s + slack";
  // The workers are unaffected.
  EXPECT_EQ(dsa::testing::HealthStatus(Channel(attention_.address), "readiness"), 1);
  EXPECT_EQ(dsa::testing::HealthStatus(Channel(indexer_.address), "readiness"), 1);
}

}  // namespace
