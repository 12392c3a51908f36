// Request migration (docs/reliability.md, "Faults survived"): the coordinator in-process over two
// real indexer servers and two real attention workers on 127.0.0.1:0. A worker is killed (its
// server shut down at once, every call in flight cancelled, new connections refused) while requests
// decode on it: each request moves to the surviving workers and completes with every token, its
// positions contiguous, Finished.migrations counting the move; nothing is left on any worker.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "attention_worker/pattern_model.h"
#include "attention_worker/service.h"
#include "common/mli_schedule.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/testing/loopback_server.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;

constexpr int kH = 4, kD = 16;
constexpr int kRequests = 4;
constexpr int64_t kContext = 300;
constexpr int64_t kNewTokens = 400;

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  return dsa::testing::ServeOnLoopback(service, address);
}

// One request's stream, read on its own thread.
struct Stream {
  std::string attention_worker;  // from Admitted
  std::string indexer_worker;
  std::atomic<int64_t> tokens{0};
  bool contiguous = true;  // every Tokens.first_position = context + tokens before it
  int migrations = -1;     // Finished.migrations
  grpc::Status status;
};

class MigrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      auto indexer = Indexer::Create({2048, kH, kD});
      ASSERT_TRUE(indexer.ok()) << indexer.status();
      indexers_.push_back(std::move(*indexer));
      indexer_services_.push_back(std::make_unique<IndexerServiceImpl>(indexers_.back().get()));
      indexer_addresses_.emplace_back();
      indexer_servers_.push_back(Serve(indexer_services_.back().get(), &indexer_addresses_.back()));
    }
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
    for (int i = 0; i < 2; ++i) {
      AttentionWorkerOptions options;
      options.kv_dim = 8;
      options.attention_heads = 2;
      options.engine.kv_capacity_slots = 1 << 16;
      options.seed = 3;
      auto attention = AttentionServiceImpl::Create(*schedule, *model, options);
      ASSERT_TRUE(attention.ok()) << attention.status();
      attention_.push_back(std::move(*attention));
      attention_addresses_.emplace_back();
      attention_servers_.push_back(Serve(attention_.back().get(), &attention_addresses_.back()));
    }
    CoordinatorOptions options;
    options.indexer_addresses = indexer_addresses_;
    options.attention_addresses = attention_addresses_;
    options.top_k = 64;
    options.seed = 11;
    options.retain_finished = false;       // so that every worker ends empty
    options.worker_check_interval_ms = 0;  // checks only at Create and on a failure
    metrics_ = std::make_unique<CoordinatorMetrics>(registry_);
    auto coordinator = CoordinatorServiceImpl::Create(options, metrics_.get());
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = std::move(*coordinator);
    coordinator_server_ = Serve(coordinator_.get(), &coordinator_address_);
    stub_ = cv1::CoordinatorService::NewStub(
        ::dsa::testing::ConnectedLoopbackChannel(coordinator_address_));
  }

  void TearDown() override {
    if (coordinator_server_) coordinator_server_->Shutdown();
    if (coordinator_) coordinator_->Stop();
    for (size_t i = 0; i < attention_servers_.size(); ++i) {
      if (attention_servers_[i]) attention_servers_[i]->Shutdown();
      attention_[i]->CloseTransports();
    }
    for (auto& server : indexer_servers_) {
      if (server) server->Shutdown();
    }
  }

  // Starts kRequests requests, each read on its own thread, and waits until every one has
  // produced at least `tokens` tokens.
  void StartRequests(int64_t tokens) {
    for (int i = 0; i < kRequests; ++i) {
      streams_.push_back(std::make_unique<Stream>());
      readers_.emplace_back([this, i] {
        Stream& s = *streams_[i];
        cv1::GenerateRequest request;
        request.set_request_id(absl::StrCat("r", i));
        request.set_context_length(kContext);
        request.set_max_new_tokens(kNewTokens);
        request.set_draft_length(i % 2 == 0 ? 0 : 2);
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        auto reader = stub_->Generate(&context, request);
        cv1::GenerateEvent event;
        while (reader->Read(&event)) {
          if (event.has_admitted()) {
            absl::MutexLock lock(&mu_);
            s.attention_worker = event.admitted().attention_worker();
            s.indexer_worker = event.admitted().indexer_worker();
          } else if (event.has_tokens()) {
            if (event.tokens().first_position() != kContext + s.tokens) s.contiguous = false;
            s.tokens += event.tokens().count();
          } else if (event.has_finished()) {
            s.migrations = event.finished().migrations();
          }
        }
        s.status = reader->Finish();
      });
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (const auto& s : streams_) {
      while (s->tokens < tokens && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      ASSERT_GE(s->tokens, tokens);
    }
  }

  void JoinRequests() {
    for (std::thread& reader : readers_) reader.join();
    readers_.clear();
  }

  // Every request completed with all its tokens at contiguous positions; the ones that ran on a
  // killed worker moved once. Returns the migrations.
  int ExpectAllCompleted(const std::vector<std::string>& killed_attention,
                         const std::string& killed_indexer) {
    int migrated = 0;
    for (const auto& s : streams_) {
      EXPECT_TRUE(s->status.ok()) << s->status.error_message();
      EXPECT_EQ(s->tokens, kNewTokens);
      EXPECT_TRUE(s->contiguous);
      bool on_killed = s->indexer_worker == killed_indexer;
      for (const std::string& a : killed_attention)
        on_killed = on_killed || s->attention_worker == a;
      if (on_killed) {
        EXPECT_EQ(s->migrations, 1) << s->attention_worker << " " << s->indexer_worker;
      } else if (!killed_indexer.empty()) {
        // A batch neighbour on the surviving indexer goes on, or, when that indexer had already
        // advanced it in the step that failed (the attention worker marks it broken), moves once.
        EXPECT_LE(s->migrations, 1) << s->attention_worker << " " << s->indexer_worker;
      } else {
        EXPECT_EQ(s->migrations, 0) << s->attention_worker << " " << s->indexer_worker;
      }
      migrated += s->migrations > 0 ? s->migrations : 0;
    }
    return migrated;
  }

  std::string Metrics() { return prometheus::TextSerializer().Serialize(registry_.Collect()); }

  int AttentionSequences(int i) {
    grpc::ClientContext context;
    av1::GetInfoResponse info;
    auto stub = av1::AttentionService::NewStub(
        grpc::CreateChannel(attention_addresses_[i], grpc::InsecureChannelCredentials()));
    EXPECT_TRUE(stub->GetInfo(&context, av1::GetInfoRequest(), &info).ok());
    return info.sequences();
  }

  std::vector<std::unique_ptr<Indexer>> indexers_;
  std::vector<std::unique_ptr<IndexerServiceImpl>> indexer_services_;
  std::vector<std::unique_ptr<grpc::Server>> indexer_servers_;
  std::vector<std::string> indexer_addresses_;
  std::vector<std::unique_ptr<AttentionServiceImpl>> attention_;
  std::vector<std::unique_ptr<grpc::Server>> attention_servers_;
  std::vector<std::string> attention_addresses_;
  prometheus::Registry registry_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_;
  std::unique_ptr<grpc::Server> coordinator_server_;
  std::string coordinator_address_;
  std::unique_ptr<cv1::CoordinatorService::Stub> stub_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<std::thread> readers_;
};

TEST_F(MigrationTest, AKilledAttentionWorkersRequestsMoveAndCompleteAndNothingIsLeft) {
  StartRequests(/*tokens=*/5);
  // Kill attention worker 0: every call in flight cancelled, no new connection.
  attention_servers_[0]->Shutdown(std::chrono::system_clock::now());
  attention_servers_[0].reset();
  JoinRequests();
  const int migrated = ExpectAllCompleted({attention_addresses_[0]}, "");
  EXPECT_GE(migrated, 1);  // the scheduler spreads requests over both attention workers
  EXPECT_NE(Metrics().find(absl::StrCat("dsa_coordinator_migrations_total ", migrated)),
            std::string::npos);
  // No orphans: the dead worker's indexer sequences were released by the coordinator, the
  // survivor's by their ends.
  for (const auto& indexer : indexers_) EXPECT_EQ(indexer->num_sequences(), 0);
  EXPECT_EQ(AttentionSequences(1), 0);
}

TEST_F(MigrationTest, AKilledIndexersRequestsMoveAndTheirBatchNeighboursGoOn) {
  StartRequests(/*tokens=*/5);
  // Kill indexer 0: the attention workers' selects to it fail mid-step, and a batch that mixed
  // sequences of both indexers fails as a whole first.
  indexer_servers_[0]->Shutdown(std::chrono::system_clock::now());
  indexer_servers_[0].reset();
  JoinRequests();
  const int migrated = ExpectAllCompleted({}, indexer_addresses_[0]);
  EXPECT_GE(migrated, 1);
  EXPECT_EQ(indexers_[1]->num_sequences(), 0);
  EXPECT_EQ(AttentionSequences(0), 0);  // no KV left for the sequences that moved
  EXPECT_EQ(AttentionSequences(1), 0);
}

TEST_F(MigrationTest, WithoutMigrationsLeftAWorkersFailureEndsItsRequestsOnly) {
  // The same kill with --max-migrations 0: the requests on the dead worker fail UNAVAILABLE
  // naming the bound, the others complete.
  coordinator_server_->Shutdown();
  coordinator_->Stop();
  CoordinatorOptions options;
  options.indexer_addresses = indexer_addresses_;
  options.attention_addresses = attention_addresses_;
  options.top_k = 64;
  options.retain_finished = false;
  options.worker_check_interval_ms = 0;
  options.max_migrations = 0;
  auto coordinator = CoordinatorServiceImpl::Create(options, metrics_.get());
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  coordinator_ = std::move(*coordinator);
  coordinator_server_ = Serve(coordinator_.get(), &coordinator_address_);
  stub_ = cv1::CoordinatorService::NewStub(
      ::dsa::testing::ConnectedLoopbackChannel(coordinator_address_));
  StartRequests(/*tokens=*/5);
  attention_servers_[0]->Shutdown(std::chrono::system_clock::now());
  attention_servers_[0].reset();
  JoinRequests();
  int failed = 0;
  for (const auto& s : streams_) {
    if (s->attention_worker == attention_addresses_[0]) {
      ++failed;
      EXPECT_EQ(s->status.error_code(), grpc::StatusCode::UNAVAILABLE) << s->status.error_message();
      EXPECT_NE(s->status.error_message().find("after 0 migrations, --max-migrations"),
                std::string::npos)
          << s->status.error_message();
    } else {
      EXPECT_TRUE(s->status.ok()) << s->status.error_message();
      EXPECT_EQ(s->tokens, kNewTokens);
    }
  }
  EXPECT_GE(failed, 1);
  for (const auto& indexer : indexers_) EXPECT_EQ(indexer->num_sequences(), 0);
}

}  // namespace
}  // namespace dsa
