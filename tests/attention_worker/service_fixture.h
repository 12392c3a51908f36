// The fixture of the attention worker service's tests (service_test.cc, service_errors_test.cc):
// the attention worker service (attention_worker/service.h) against a real indexer service, both
// in-process on 127.0.0.1:0, with a twin dsa::Indexer fed the keys and queries the pattern model
// gives (slot by slot, by the rule of docs/services.md) and SparseAttention over KV rows generated
// here for the expected values.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attention_worker/service.h"
#include "attention_worker/sparse_attention.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "tests/testing/loopback_server.h"
#include "transport/grpc_indexer_client.h"

namespace dsa::attention_service_testing {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

inline constexpr int kH = 8, kD = 32, kK = 64;
inline constexpr int kKvDim = 16, kAttentionHeads = 4;
inline constexpr uint64_t kSeed = 5;
inline constexpr double kRho = 0.4;
inline constexpr uint64_t kSpinSeed = 7;

// One row the service attended (copied from the observer).
struct Recorded {
  uint64_t sequence_id;
  int model_layer;
  int attended_full_layer;
  int64_t position;
  std::vector<int32_t> selection;
  std::vector<float> output;
};

// A client context whose call fails rather than hangs.
inline void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
}

// An indexer service on its own in-process server.
struct IndexerServer {
  std::unique_ptr<Indexer> indexer;
  std::unique_ptr<IndexerServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<iv1::IndexerService::Stub> stub;
  std::string address;

  // A select stream left open by a failed test must not hold the shutdown forever.
  ~IndexerServer() {
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  iv1::GetLoadResponse Load() const {
    grpc::ClientContext context;
    SetDeadline(&context);
    iv1::GetLoadResponse response;
    EXPECT_TRUE(stub->GetLoad(&context, iv1::GetLoadRequest(), &response).ok());
    return response;
  }
};

// `clock` is its leases' (IndexerServiceImpl).
inline std::unique_ptr<IndexerServer> StartIndexer(int64_t capacity_blocks, int num_heads = kH,
                                                   int head_dim = kD, double audit_fraction = 0,
                                                   const Clock* clock = &RealClock()) {
  auto server = std::make_unique<IndexerServer>();
  auto indexer = Indexer::Create({capacity_blocks, num_heads, head_dim, audit_fraction});
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  server->indexer = std::move(*indexer);
  server->service = std::make_unique<IndexerServiceImpl>(server->indexer.get(), nullptr,
                                                         std::vector<std::string>{}, clock);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(server->service.get());
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  server->server = builder.BuildAndStart();
  EXPECT_GT(port, 0);
  server->address = absl::StrCat("127.0.0.1:", port);
  server->stub =
      iv1::IndexerService::NewStub(::dsa::testing::ConnectedLoopbackChannel(server->address));
  return server;
}

// Histogram sample count or gauge value of family `name` with label (key, value); -1 if absent.
inline double MetricValue(prometheus::Registry& registry, const std::string& name,
                          const std::string& key, const std::string& value) {
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      const bool match = key.empty() ? metric.label.empty()
                                     : (metric.label.size() == 1 && metric.label[0].name == key &&
                                        metric.label[0].value == value);
      if (!match) continue;
      if (family.type == prometheus::MetricType::Histogram) {
        return static_cast<double>(metric.histogram.sample_count);
      }
      return metric.gauge.value;
    }
  }
  return -1;
}

// A prefill held mid-way: the first IndexKeyAppend of any sequence writes its first chunk to the
// indexer, says so (`entered`) and waits for `release`: by then the KV is reserved, the indexer
// sequence created and keys appended, whatever the machine's speed.
struct PrefillHold {
  absl::Notification entered;
  absl::Notification release;
};

class HeldAppend final : public IndexKeyAppend {
 public:
  HeldAppend(std::unique_ptr<IndexKeyAppend> inner, PrefillHold* hold)
      : inner_(std::move(inner)), hold_(hold) {}
  bool Write(int layer, int64_t first_slot, std::span<const float> keys,
             int64_t num_keys) override {
    const bool written = inner_->Write(layer, first_slot, keys, num_keys);
    if (!hold_->entered.HasBeenNotified()) {
      hold_->entered.Notify();
      hold_->release.WaitForNotification();
    }
    return written;
  }
  absl::StatusOr<int64_t> Finish() override { return inner_->Finish(); }
  void Cancel() override { inner_->Cancel(); }

 private:
  std::unique_ptr<IndexKeyAppend> inner_;
  PrefillHold* hold_;
};

// A gRPC indexer client whose appends are HeldAppends; everything else goes to `inner`.
class HeldAppendClient final : public IndexerClient {
 public:
  HeldAppendClient(std::shared_ptr<IndexerClient> inner, PrefillHold* hold)
      : inner_(std::move(inner)), hold_(hold) {}
  const std::string& address() const override { return inner_->address(); }
  absl::StatusOr<IndexerShape> GetShape(absl::Time deadline) override {
    return inner_->GetShape(deadline);
  }
  absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time deadline) override {
    return inner_->CreateSequence(spec, deadline);
  }
  std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t sequence_id, absl::Time deadline) override {
    return std::make_unique<HeldAppend>(inner_->BeginAppend(sequence_id, deadline), hold_);
  }
  absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) override {
    return inner_->BeginTurn(sequence_id, deadline);
  }
  absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) override {
    return inner_->Commit(sequence_id, accepted, deadline);
  }
  absl::Status Release(uint64_t sequence_id, absl::Time deadline) override {
    return inner_->Release(sequence_id, deadline);
  }
  SelectionTransport& Selections() override { return inner_->Selections(); }
  absl::Status Close() override { return inner_->Close(); }
  bool DataPlaneEnded() const override { return inner_->DataPlaneEnded(); }

 private:
  std::shared_ptr<IndexerClient> inner_;
  PrefillHold* hold_;
};

// The server side of the attention service's Prefill calls: the call's context (for
// IsCancelled) once the call starts, and the status the handler returned (`answered`).
class PrefillCalls final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (std::string(info->method()) != "/dsa.attention.v1.AttentionService/Prefill") {
      return nullptr;
    }
    context_.store(info->server_context());
    return new Recorder(this);
  }

  grpc::ServerContextBase* context() const { return context_.load(); }
  absl::Notification answered;
  grpc::Status status;  // set before `answered`

 private:
  class Recorder final : public grpc::experimental::Interceptor {
   public:
    explicit Recorder(PrefillCalls* calls) : calls_(calls) {}
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
      if (methods->QueryInterceptionHookPoint(
              grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
        calls_->status = methods->GetSendStatus();
        calls_->answered.Notify();
      }
      methods->Proceed();
    }

   private:
    PrefillCalls* calls_;
  };
  std::atomic<grpc::ServerContextBase*> context_{nullptr};
};

class AttentionServiceTest : public ::testing::Test {
 protected:
  // Starts the indexer (capacity in blocks) and the attention worker over `pattern`, lag `lag`.
  void Start(int64_t indexer_blocks, const std::string& pattern = "FSFSFS", int lag = 1,
             int64_t kv_capacity_slots = 1 << 20) {
    indexer_ = StartIndexer(indexer_blocks, kH, kD, audit_fraction_);
    auto schedule = MliSchedule::FromPattern(pattern, lag);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    schedule_ = std::make_unique<MliSchedule>(*schedule);
    // Plain patterns: SPIN's pruning loses a few slots on these short contexts.
    PatternModelConfig config = SpinFigurePatternConfig();
    config.num_layers = static_cast<int>(schedule->full_layers().size());
    config.num_heads = kH;
    config.head_dim = kD;
    config.seed = kSeed;
    config.num_diagonals = 2;  // of round(0.25 * 8) = 2 positional heads
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<PatternModel>(*model);
    AttentionWorkerOptions options;
    options.kv_dim = kKvDim;
    options.attention_heads = kAttentionHeads;
    options.engine.kv_capacity_slots = kv_capacity_slots;
    options.seed = kSeed;
    options.engine.observer = [this](const AttendedRow& row) {
      std::lock_guard<std::mutex> lock(recorded_mutex_);
      recorded_.push_back({row.sequence_id, row.model_layer, row.attended_full_layer, row.position,
                           std::vector<int32_t>(row.selection.begin(), row.selection.end()),
                           std::vector<float>(row.output.begin(), row.output.end())});
    };
    registry_ = std::make_shared<prometheus::Registry>();
    metrics_ = std::make_unique<AttentionMetrics>(*registry_, schedule->num_layers());
    if (hold_ == nullptr) {
      auto service = AttentionServiceImpl::Create(*schedule, *model, options, metrics_.get());
      ASSERT_TRUE(service.ok()) << service.status();
      service_ = std::move(*service);
    } else {
      // Create's wiring, with the gRPC clients' appends held.
      IndexerClientFactory grpc_clients = GrpcIndexerClient::Factory();
      IndexerClientFactory held =
          [grpc_clients, hold = hold_](
              const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
        absl::StatusOr<std::shared_ptr<IndexerClient>> client = grpc_clients(address);
        if (!client.ok()) return client.status();
        return std::make_shared<HeldAppendClient>(*std::move(client), hold);
      };
      auto engine =
          MakeCpuAttentionEngine(*schedule, *model, options, std::move(held), metrics_.get());
      ASSERT_TRUE(engine.ok()) << engine.status();
      service_ = std::make_unique<AttentionServiceImpl>(std::move(*engine));
    }
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    if (prefill_calls_ != nullptr) {
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
      creators.push_back(std::move(prefill_calls_owned_));
      builder.experimental().SetInterceptorCreators(std::move(creators));
    }
    server_ = builder.BuildAndStart();
    ASSERT_GT(port, 0);
    stub_ = av1::AttentionService::NewStub(
        ::dsa::testing::ConnectedLoopbackChannel(absl::StrCat("127.0.0.1:", port)));
    auto twin = Indexer::Create({1 << 16, kH, kD, audit_fraction_});
    ASSERT_TRUE(twin.ok());
    twin_ = std::move(*twin);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (service_) service_->CloseTransports();
    indexer_.reset();
  }

  av1::PrefillRequest PrefillRequest(uint64_t id, int64_t context,
                                     const std::vector<uint64_t>& prefix_ids = {}) const {
    av1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_context_length(context);
    for (uint64_t p : prefix_ids) request.add_prefix_block_ids(p);
    request.set_indexer_worker(indexer_->address);
    request.mutable_settings()->set_top_k(kK);
    request.mutable_settings()->mutable_spin()->set_target_block_sparsity(kRho);
    request.mutable_settings()->mutable_spin()->set_seed(kSpinSeed);
    return request;
  }

  grpc::Status Prefill(const av1::PrefillRequest& request, av1::PrefillResponse* response) {
    grpc::ClientContext context;
    SetDeadline(&context);
    return stub_->Prefill(&context, request, response);
  }

  void MustPrefill(const av1::PrefillRequest& request) {
    av1::PrefillResponse response;
    const grpc::Status status = Prefill(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.slots(), request.context_length());
  }

  grpc::Status Step(const std::vector<std::pair<uint64_t, int>>& sequences,
                    av1::DecodeStepResponse* response) {
    av1::DecodeStepRequest request;
    for (const auto& [id, rows] : sequences) {
      av1::SequenceStep* step = request.add_sequences();
      step->set_sequence_id(id);
      step->set_rows(rows);
    }
    grpc::ClientContext context;
    SetDeadline(&context);
    return stub_->DecodeStep(&context, request, response);
  }

  grpc::Status Commit(uint64_t id, int accepted) {
    grpc::ClientContext context;
    SetDeadline(&context);
    av1::CommitRequest request;
    request.set_sequence_id(id);
    request.set_accepted(accepted);
    av1::CommitResponse response;
    return stub_->Commit(&context, request, &response);
  }

  grpc::Status Release(uint64_t id, bool keep_indexer_sequence = false) {
    grpc::ClientContext context;
    SetDeadline(&context);
    av1::ReleaseRequest request;
    request.set_sequence_id(id);
    request.set_keep_indexer_sequence(keep_indexer_sequence);
    av1::ReleaseResponse response;
    return stub_->Release(&context, request, &response);
  }

  av1::GetInfoResponse Info() {
    grpc::ClientContext context;
    SetDeadline(&context);
    av1::GetInfoResponse response;
    EXPECT_TRUE(stub_->GetInfo(&context, av1::GetInfoRequest(), &response).ok());
    return response;
  }

  // The key of one slot by the rule of docs/services.md, one slot at a time.
  std::vector<float> ReferenceKeys(int full_layer, const std::vector<uint64_t>& prefix_ids,
                                   int64_t first_slot, int64_t num_slots) const {
    std::vector<float> keys(static_cast<size_t>(num_slots * kD));
    for (int64_t i = 0; i < num_slots; ++i) {
      const int64_t slot = first_slot + i;
      std::span<float> out(keys.data() + i * kD, kD);
      if (slot < kPrefixBlockTokens * static_cast<int64_t>(prefix_ids.size())) {
        EXPECT_TRUE(model_
                        ->PrefixBlockIndexKeys(full_layer, prefix_ids[slot / kPrefixBlockTokens],
                                               static_cast<int>(slot % kPrefixBlockTokens), slot, 1,
                                               out)
                        .ok());
      } else {
        EXPECT_TRUE(model_->IndexKeys(full_layer, slot, 1, out).ok());
      }
    }
    return keys;
  }

  // Creates `id` on the twin with the prefill's settings and appends [0, context)'s keys.
  void TwinPrefill(uint64_t id, int64_t context, const std::vector<uint64_t>& prefix_ids = {}) {
    SequenceOptions options;
    options.num_layers = model_->num_layers();
    options.top_k = kK;
    options.spin.target_block_sparsity = kRho;
    options.spin.seed = kSpinSeed;
    ASSERT_TRUE(twin_->CreateSequence(id, options).ok());
    for (int f = 0; f < model_->num_layers(); ++f) {
      ASSERT_TRUE(
          twin_->AppendIndexKeys(id, f, ReferenceKeys(f, prefix_ids, 0, context), context).ok());
    }
  }

  // The twin's selections of one step of `rows` rows at t for sequence `id`: per full layer
  // int32 [rows, K].
  std::vector<std::vector<int32_t>> TwinStep(uint64_t id, int64_t t, int rows,
                                             const std::vector<uint64_t>& prefix_ids = {},
                                             std::vector<double>* audit_miss_rates = nullptr) {
    std::vector<std::vector<int32_t>> selections;
    for (int f = 0; f < model_->num_layers(); ++f) {
      EXPECT_TRUE(twin_->AppendIndexKeys(id, f, ReferenceKeys(f, prefix_ids, t, rows), rows).ok());
      std::vector<float> queries(static_cast<size_t>(rows) * kH * kD);
      std::vector<float> weights(static_cast<size_t>(rows) * kH);
      std::vector<IndexerRow> engine_rows(rows);
      for (int r = 0; r < rows; ++r) {
        std::span<float> q(queries.data() + r * kH * kD, kH * kD);
        std::span<float> w(weights.data() + r * kH, kH);
        EXPECT_TRUE(model_->IndexerQuery(f, t + r, q, w).ok());
        engine_rows[r] = {q, w, t + r};
      }
      auto result = twin_->Select(id, f, engine_rows);
      EXPECT_TRUE(result.ok()) << result.status();
      selections.push_back(result.ok() ? result->selections : std::vector<int32_t>{});
      if (result.ok() && audit_miss_rates != nullptr) {
        audit_miss_rates->insert(audit_miss_rates->end(), result->audit_miss_rates.begin(),
                                 result->audit_miss_rates.end());
      }
    }
    return selections;
  }

  // Checks the rows the service attended for `id` at positions t..t+rows-1 (one step) against the
  // twin's selections and SparseAttention over the reference KV cache; removes those records.
  void ExpectAttended(uint64_t id, int64_t t, int rows,
                      const std::vector<std::vector<int32_t>>& twin_selections) {
    std::vector<Recorded> rows_of_id;
    {
      std::lock_guard<std::mutex> lock(recorded_mutex_);
      const auto of_step = [id, t, rows](const Recorded& r) {
        return r.sequence_id == id && r.position >= t && r.position < t + rows;
      };
      for (Recorded& r : recorded_) {
        if (of_step(r)) rows_of_id.push_back(r);
      }
      std::erase_if(recorded_, of_step);
    }
    ASSERT_EQ(rows_of_id.size(), static_cast<size_t>(schedule_->num_layers() * rows));
    std::vector<int> full_rank(schedule_->num_layers(), -1);
    for (size_t f = 0; f < schedule_->full_layers().size(); ++f) {
      full_rank[schedule_->full_layers()[f]] = static_cast<int>(f);
    }
    size_t index = 0;
    for (int l = 0; l < schedule_->num_layers(); ++l) {
      const int sigma = schedule_->AttendedLayer(l);
      for (int r = 0; r < rows; ++r, ++index) {
        const Recorded& got = rows_of_id[index];
        const int64_t position = t + r;
        ASSERT_EQ(got.model_layer, l);
        ASSERT_EQ(got.position, position);
        ASSERT_EQ(got.attended_full_layer, sigma);
        const std::vector<int32_t>& all = twin_selections[full_rank[sigma]];
        const std::vector<int32_t> expected(all.begin() + r * kK, all.begin() + (r + 1) * kK);
        ASSERT_EQ(got.selection, expected) << "layer " << l << " row " << r;
        // Attention over the reference KV cache.
        const int64_t num_slots = position + 1;
        std::vector<float> keys(num_slots * kKvDim), values(num_slots * kKvDim);
        for (int64_t s = 0; s < num_slots; ++s) {
          KvCacheRow(kSeed, l, s, std::span<float>(keys.data() + s * kKvDim, kKvDim),
                     std::span<float>(values.data() + s * kKvDim, kKvDim));
        }
        std::vector<float> query(kAttentionHeads * kKvDim), out(kAttentionHeads * kKvDim);
        AttentionQuery(kSeed, l, position, query);
        ASSERT_TRUE(SparseAttention({kAttentionHeads, kKvDim, kKvDim, 0}, query, keys, values,
                                    num_slots, expected, out)
                        .ok());
        ASSERT_EQ(got.output, out) << "layer " << l << " row " << r;
      }
    }
  }

  double audit_fraction_ = 0;    // of the indexer started by Start()
  PrefillHold* hold_ = nullptr;  // set before Start(): the gRPC clients' appends are held
  // Set before Start() (HoldPrefills): the attention server records its Prefill calls there.
  std::unique_ptr<PrefillCalls> prefill_calls_owned_;
  PrefillCalls* prefill_calls_ = nullptr;
  std::unique_ptr<IndexerServer> indexer_;
  std::unique_ptr<Indexer> twin_;
  std::unique_ptr<MliSchedule> schedule_;
  std::unique_ptr<PatternModel> model_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<AttentionMetrics> metrics_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<av1::AttentionService::Stub> stub_;
  std::mutex recorded_mutex_;
  std::vector<Recorded> recorded_;
};

}  // namespace dsa::attention_service_testing
