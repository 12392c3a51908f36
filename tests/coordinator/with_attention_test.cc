// The coordinator service in-process over the real attention worker (attention_worker/service.h)
// and a real indexer server, on 127.0.0.1:0: exact token counts with speculative rows, the
// indexer's block counts and per-layer selection waits carried in Tokens, prefix sharing accepted
// by the real workers, a session's second turn, and concurrent requests.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/pattern_model.h"
#include "attention_worker/service.h"
#include "common/mli_schedule.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "tests/coordinator/generate_client.h"
#include "tests/testing/loopback_server.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;

using coordinator_testing::Request;
using coordinator_testing::Stream;

constexpr int kH = 4, kD = 16;

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  return dsa::testing::ServeOnLoopback(service, address);
}

class CoordinatorWithAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto indexer = Indexer::Create({2048, kH, kD});
    ASSERT_TRUE(indexer.ok()) << indexer.status();
    indexer_ = std::move(*indexer);
    indexer_service_ = std::make_unique<IndexerServiceImpl>(indexer_.get());
    indexer_server_ = Serve(indexer_service_.get(), &indexer_address_);

    auto schedule = MliSchedule::FromPattern("FSFS", 1);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    PatternModelConfig config;
    config.num_layers = static_cast<int>(schedule->full_layers().size());
    config.num_heads = kH;
    config.head_dim = kD;
    config.seed = 3;
    config.num_diagonals = 1;
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok()) << model.status();
    AttentionWorkerOptions options;
    options.kv_dim = 8;
    options.attention_heads = 2;
    options.engine.kv_capacity_slots = 1 << 16;
    options.seed = 3;
    auto attention = AttentionServiceImpl::Create(*schedule, *model, options);
    ASSERT_TRUE(attention.ok()) << attention.status();
    attention_ = std::move(*attention);
    attention_server_ = Serve(attention_.get(), &attention_address_);

    CoordinatorOptions coordinator_options;
    coordinator_options.indexer_addresses = {indexer_address_};
    coordinator_options.attention_addresses = {attention_address_};
    coordinator_options.top_k = 64;
    coordinator_options.seed = 11;
    metrics_ = std::make_unique<CoordinatorMetrics>(registry_);
    auto coordinator = CoordinatorServiceImpl::Create(coordinator_options, metrics_.get());
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = std::move(*coordinator);
    coordinator_server_ = Serve(coordinator_.get(), &coordinator_address_);
    stub_ = cv1::CoordinatorService::NewStub(
        ::dsa::testing::ConnectedLoopbackChannel(coordinator_address_));
  }

  void TearDown() override {
    if (coordinator_server_) coordinator_server_->Shutdown();
    if (coordinator_) coordinator_->Stop();
    if (attention_server_) attention_server_->Shutdown();
    if (attention_) attention_->CloseTransports();
    if (indexer_server_) indexer_server_->Shutdown();
  }

  // The real worker attends on the CPU: a deadline of 60 s, not the in-process fixture's 30 s.
  Stream Generate(const cv1::GenerateRequest& request) {
    return coordinator_testing::Generate(*stub_, request, std::chrono::seconds(60));
  }

  std::unique_ptr<Indexer> indexer_;
  std::unique_ptr<IndexerServiceImpl> indexer_service_;
  std::unique_ptr<grpc::Server> indexer_server_;
  std::string indexer_address_;
  std::unique_ptr<AttentionServiceImpl> attention_;
  std::unique_ptr<grpc::Server> attention_server_;
  std::string attention_address_;
  prometheus::Registry registry_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_;
  std::unique_ptr<grpc::Server> coordinator_server_;
  std::string coordinator_address_;
  std::unique_ptr<cv1::CoordinatorService::Stub> stub_;
};

TEST_F(CoordinatorWithAttentionTest, SpeculativeStreamHasExactCountsAndTheIndexersFigures) {
  EXPECT_EQ(coordinator_->num_full_layers(), 2);
  const Stream s = Generate(Request("spec", 400, 13, 3));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.TokenCount(), 13);
  ASSERT_TRUE(s.events.back().has_finished());
  EXPECT_EQ(s.events.back().finished().generated_tokens(), 13);
  int64_t position = 400;
  for (const auto& e : s.events) {
    if (!e.has_tokens()) continue;
    EXPECT_EQ(e.tokens().first_position(), position);
    position += e.tokens().count();
    EXPECT_GT(e.tokens().blocks_visible(), 0);
    EXPECT_GT(e.tokens().blocks_scored(), 0);
    EXPECT_LE(e.tokens().blocks_scored(), e.tokens().blocks_visible());
    EXPECT_EQ(e.tokens().selection_wait_seconds_size(), 4);  // one per model layer
  }
  // The indexer holds the sequence (a retained donor) at its final length: 413 slots per layer.
  const CacheUsage usage = indexer_->Usage();
  EXPECT_EQ(usage.used_blocks, 2 * 7);  // ceil(413 / 64) = 7 blocks per full layer
}

TEST_F(CoordinatorWithAttentionTest, PrefixSharingAndSessionTurnsOverTheRealWorkers) {
  cv1::GenerateRequest donor = Request("donor", 1100, 3);
  for (uint64_t id : {5, 6, 7}) donor.add_prefix_block_ids(id);
  ASSERT_TRUE(Generate(donor).status.ok());
  cv1::GenerateRequest user = Request("user", 1300, 3, 2);
  for (uint64_t id : {5, 6, 7}) user.add_prefix_block_ids(id);
  const Stream u = Generate(user);
  ASSERT_TRUE(u.status.ok()) << u.status.error_message();
  EXPECT_EQ(u.events.front().admitted().prefix_slots_reused(), 1024);
  EXPECT_EQ(u.TokenCount(), 3);

  cv1::GenerateRequest turn1 = Request("turn1", 200, 5, 1);
  turn1.set_session_id("s");
  ASSERT_TRUE(Generate(turn1).status.ok());
  cv1::GenerateRequest turn2 = Request("turn2", 260, 5, 1);
  turn2.set_session_id("s");
  const Stream t2 = Generate(turn2);
  ASSERT_TRUE(t2.status.ok()) << t2.status.error_message();
  EXPECT_EQ(t2.TokenCount(), 5);
  EXPECT_EQ(t2.events[1].tokens().first_position(), 260);
}

TEST_F(CoordinatorWithAttentionTest, ConcurrentRequestsAllCompleteExactly) {
  std::vector<Stream> streams(4);
  std::vector<std::thread> threads;
  threads.reserve(streams.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    threads.emplace_back([this, &streams, i] {
      streams[i] = Generate(Request(absl::StrCat("c", i), 150 + 40 * i, 20, static_cast<int>(i)));
    });
  }
  for (auto& t : threads) t.join();
  for (const Stream& s : streams) {
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.TokenCount(), 20);
  }
}

}  // namespace
}  // namespace dsa
