// The fixture of the coordinator service's in-process tests (service_test.cc,
// service_workers_test.cc): real in-process indexer servers, fake attention workers
// (fake_attention.h) and the coordinator, each on 127.0.0.1:0, with helpers to call it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/coordinator/fake_attention.h"
#include "tests/coordinator/generate_client.h"
#include "tests/coordinator/tiny_model.h"
#include "tests/testing/loopback_server.h"

namespace dsa {
namespace service_testing {

namespace av1 = ::dsa::attention::v1;
namespace cv1 = ::dsa::coordinator::v1;
using coordinator_testing::Generate;
using coordinator_testing::Request;
using coordinator_testing::Stream;
using testing::FakeAttentionService;
using ::testing::HasSubstr;

inline constexpr int kLayers = 2, kHeads = 4, kDim = 16;

inline std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  return dsa::testing::ServeOnLoopback(service, address);
}

struct ClusterOptions {
  int num_indexers = 1;
  int num_attention = 1;
  int64_t capacity_blocks = 4096;
  int max_queue = 8;
  int max_running = 32;
  bool retain_finished = true;
  double acceptance_rate = 0.7;
  int max_pending_events = 16;
  int64_t stall_timeout_ms = 60000;
  bool tiny_model = false;  // the attention workers run the tiny real model (tiny_model.h)
};

// Real indexers, fake attention workers and the coordinator, each on its own port.
class Cluster {
 public:
  explicit Cluster(const ClusterOptions& o = {}) {
    for (int i = 0; i < o.num_indexers; ++i) {
      IndexerOptions options;
      options.capacity_blocks = o.capacity_blocks;
      options.num_heads = kHeads;
      options.head_dim = kDim;
      engines_.push_back(*Indexer::Create(options));
      indexer_services_.push_back(std::make_unique<IndexerServiceImpl>(engines_.back().get()));
      indexer_addresses_.emplace_back();
      servers_.push_back(Serve(indexer_services_.back().get(), &indexer_addresses_.back()));
    }
    for (int j = 0; j < o.num_attention; ++j) {
      FakeAttentionService::Shape shape{kLayers, kHeads, kDim, 0};
      if (o.tiny_model) {
        shape.model = "tiny";
        shape.vocab_size = dsa::testing::kTinyVocab;
        shape.eos_token_id = dsa::testing::kTinyEos;
        shape.max_context = 4096;
      }
      fakes_.push_back(std::make_unique<FakeAttentionService>(shape));
      attention_addresses_.emplace_back();
      servers_.push_back(Serve(fakes_.back().get(), &attention_addresses_.back()));
    }
    options_.indexer_addresses = indexer_addresses_;
    options_.attention_addresses = attention_addresses_;
    options_.max_queue = o.max_queue;
    options_.max_running_per_attention = o.max_running;
    options_.retain_finished = o.retain_finished;
    options_.acceptance_rate = o.acceptance_rate;
    options_.top_k = 64;
    options_.seed = 7;
    options_.max_pending_events = o.max_pending_events;
    options_.stall_timeout_ms = o.stall_timeout_ms;
    options_.worker_check_interval_ms = 0;  // no watch thread: tests call RefreshWorkers
    metrics_ = std::make_unique<CoordinatorMetrics>(registry_);
    auto service = CoordinatorServiceImpl::Create(options_, metrics_.get());
    EXPECT_TRUE(service.ok()) << service.status();
    coordinator_ = *std::move(service);
    coordinator_server_ = Serve(coordinator_.get(), &coordinator_address_);
    stub_ = cv1::CoordinatorService::NewStub(
        ::dsa::testing::ConnectedLoopbackChannel(coordinator_address_));
  }
  ~Cluster() {
    coordinator_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    coordinator_->Stop();
    for (auto& server : servers_) server->Shutdown();
  }

  cv1::CoordinatorService::Stub& stub() { return *stub_; }
  // Stops attention worker j's server (a worker lost); its fake stays for inspection.
  void StopAttention(int j) {
    servers_[indexer_addresses_.size() + j]->Shutdown(std::chrono::system_clock::now());
  }
  FakeAttentionService& fake(int j = 0) { return *fakes_[j]; }
  Indexer& engine(int i = 0) { return *engines_[i]; }
  CoordinatorServiceImpl& coordinator() { return *coordinator_; }
  const std::string& coordinator_address() const { return coordinator_address_; }
  const std::string& indexer_address(int i = 0) const { return indexer_addresses_[i]; }
  const std::string& attention_address(int j = 0) const { return attention_addresses_[j]; }
  std::string Metrics() { return prometheus::TextSerializer().Serialize(registry_.Collect()); }

 private:
  std::vector<std::unique_ptr<Indexer>> engines_;
  std::vector<std::unique_ptr<IndexerServiceImpl>> indexer_services_;
  std::vector<std::unique_ptr<FakeAttentionService>> fakes_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> indexer_addresses_;
  std::vector<std::string> attention_addresses_;
  CoordinatorOptions options_;
  prometheus::Registry registry_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_;
  std::unique_ptr<grpc::Server> coordinator_server_;
  std::string coordinator_address_;
  std::unique_ptr<cv1::CoordinatorService::Stub> stub_;
};

inline cv1::GetLoadResponse Load(cv1::CoordinatorService::Stub& stub) {
  grpc::ClientContext context;
  cv1::GetLoadResponse load;
  EXPECT_TRUE(stub.GetLoad(&context, cv1::GetLoadRequest(), &load).ok());
  return load;
}

inline grpc::Status Abort(cv1::CoordinatorService::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  cv1::AbortRequest request;
  request.set_request_id(id);
  cv1::AbortResponse response;
  return stub.Abort(&context, request, &response);
}

// Polls `done` every 5 ms for up to 5 s. Only for the coordinator's state as its RPCs report it
// (GetLoad, metrics), which no event announces; the fake's state has its Await... methods.
template <typename F>
bool WaitFor(F done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a poll interval
  }
  return done();
}

}  // namespace service_testing
}  // namespace dsa
