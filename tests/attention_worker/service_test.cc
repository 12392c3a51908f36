// Tests of the attention worker service (attention_worker/service.h) against a real indexer
// service, both in-process on 127.0.0.1:0. Expected values come from a twin dsa::Indexer fed the
// keys and queries the pattern model gives (slot by slot, by the rule of docs/services.md), and
// from SparseAttention over KV rows generated here: prefill appends exactly those keys, decode
// steps attend the selection of sigma(l), speculative steps commit, prefixes are shared, errors are
// precise and leave nothing behind.
#include "attention_worker/service.h"

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
#include "attention_worker/sparse_attention.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "transport/grpc_indexer_client.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

constexpr int kH = 8, kD = 32, kK = 64;
constexpr int kKvDim = 16, kAttentionHeads = 4;
constexpr uint64_t kSeed = 5;
constexpr double kRho = 0.4;
constexpr uint64_t kSpinSeed = 7;

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
void SetDeadline(grpc::ClientContext* context) {
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

std::unique_ptr<IndexerServer> StartIndexer(int64_t capacity_blocks, int num_heads = kH,
                                            int head_dim = kD, double audit_fraction = 0) {
  auto server = std::make_unique<IndexerServer>();
  auto indexer = Indexer::Create({capacity_blocks, num_heads, head_dim, audit_fraction});
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  server->indexer = std::move(*indexer);
  server->service = std::make_unique<IndexerServiceImpl>(server->indexer.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(server->service.get());
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  server->server = builder.BuildAndStart();
  EXPECT_GT(port, 0);
  server->address = absl::StrCat("127.0.0.1:", port);
  server->stub = iv1::IndexerService::NewStub(
      grpc::CreateChannel(server->address, grpc::InsecureChannelCredentials()));
  return server;
}

// Histogram sample count or gauge value of family `name` with label (key, value); -1 if absent.
double MetricValue(prometheus::Registry& registry, const std::string& name, const std::string& key,
                   const std::string& value) {
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
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
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

TEST_F(AttentionServiceTest, PrefillAppendsThePatternModelKeysAndStepsAttendSigmaOfEachLayer) {
  Start(/*indexer_blocks=*/1024, "FSFSFSFS", /*lag=*/1);
  const std::vector<uint64_t> ids = {101, 102};  // slots [0, 1024) from prefix blocks
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(PrefillRequest(1, 1500, ids), &prefilled).ok());
  EXPECT_EQ(prefilled.slots(), 1500);
  EXPECT_EQ(prefilled.slots_appended(), 1500);
  ASSERT_TRUE(Prefill(PrefillRequest(2, 900), &prefilled).ok());
  for (int f = 0; f < 4; ++f) {
    EXPECT_EQ(*indexer_->indexer->NumSlots(1, f), 1500);
    EXPECT_EQ(*indexer_->indexer->NumSlots(2, f), 900);
  }
  TwinPrefill(1, 1500, ids);
  TwinPrefill(2, 900);
  EXPECT_EQ(Info().kv_used_slots(), 2400);
  EXPECT_EQ(Info().sequences(), 2);

  // Three one-row steps of both sequences in one batch each.
  for (int step = 0; step < 3; ++step) {
    av1::DecodeStepResponse response;
    ASSERT_TRUE(Step({{1, 1}, {2, 1}}, &response).ok());
    ASSERT_EQ(response.sequences_size(), 2);
    EXPECT_EQ(response.sequences(0).sequence_id(), 1u);
    EXPECT_EQ(response.sequences(0).first_position(), 1500 + step);
    EXPECT_EQ(response.sequences(1).first_position(), 900 + step);
    // Four full layers, ceil((t + 1) / 64) visible blocks each.
    EXPECT_EQ(response.sequences(0).blocks_visible(), 4 * ((1500 + step + 1 + 63) / 64));
    EXPECT_LE(response.sequences(0).blocks_scored(), response.sequences(0).blocks_visible());
    EXPECT_GT(response.sequences(0).blocks_scored(), 0);
    ASSERT_EQ(response.selection_wait_seconds_size(), 8);
    for (double wait : response.selection_wait_seconds()) EXPECT_GE(wait, 0.0);
    EXPECT_GT(response.seconds(), 0.0);
    ExpectAttended(1, 1500 + step, 1, TwinStep(1, 1500 + step, 1, ids));
    ExpectAttended(2, 900 + step, 1, TwinStep(2, 900 + step, 1));
  }
  // SPIN pruned after the warm-up step.
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{1, 1}}, &response).ok());
  EXPECT_LT(response.sequences(0).blocks_scored(), response.sequences(0).blocks_visible());
  ExpectAttended(1, 1503, 1, TwinStep(1, 1503, 1, ids));
  EXPECT_EQ(*indexer_->indexer->NumSlots(1, 3), 1504);
  EXPECT_EQ(Info().kv_used_slots(), 1504 + 903);

  // Metrics: one wait sample per model layer and step, no sequence labels.
  for (int l = 0; l < 8; ++l) {
    EXPECT_EQ(
        MetricValue(*registry_, "dsa_attention_selection_wait_seconds", "layer", std::to_string(l)),
        4)
        << l;
  }
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_decode_step_duration_seconds", "", ""), 4);
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_prefill_duration_seconds", "", ""), 2);
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_kv_slots", "state", "used"), 1504 + 903);
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_kv_slots", "state", "free"),
            (1 << 20) - (1504 + 903));
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_sequences", "", ""), 2);
}

TEST_F(AttentionServiceTest, LagDepthTwoAttendsTwoFullLayersBack) {
  Start(/*indexer_blocks=*/512, "FSSFSFFS", /*lag=*/2);
  MustPrefill(PrefillRequest(9, 700));
  TwinPrefill(9, 700);
  for (int step = 0; step < 2; ++step) {
    av1::DecodeStepResponse response;
    ASSERT_TRUE(Step({{9, 1}}, &response).ok());
    ExpectAttended(9, 700 + step, 1, TwinStep(9, 700 + step, 1));
  }
}

TEST_F(AttentionServiceTest, LongPrefillIsSentInChunksUnderTheMessageLimit) {
  // 40000 slots x 32 dims x 4 bytes = 5.1 MB per layer: two chunks per layer.
  Start(/*indexer_blocks=*/4096, "FSFS", /*lag=*/1);
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(PrefillRequest(3, 40000, {7, 8, 9}), &prefilled).ok());
  EXPECT_EQ(prefilled.slots_appended(), 40000);
  TwinPrefill(3, 40000, {7, 8, 9});
  EXPECT_EQ(*indexer_->indexer->NumSlots(3, 0), 40000);
  EXPECT_EQ(*indexer_->indexer->NumSlots(3, 1), 40000);
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{3, 1}}, &response).ok());
  ExpectAttended(3, 40000, 1, TwinStep(3, 40000, 1, {7, 8, 9}));
}

TEST_F(AttentionServiceTest, SpeculativeStepAwaitsCommitWhichTruncates) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(4, 700));
  MustPrefill(PrefillRequest(5, 800));
  TwinPrefill(4, 700);
  TwinPrefill(5, 800);
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{4, 3}, {5, 1}}, &response).ok());
  ExpectAttended(4, 700, 3, TwinStep(4, 700, 3));
  ExpectAttended(5, 800, 1, TwinStep(5, 800, 1));
  EXPECT_EQ(Info().kv_used_slots(), 703 + 801);
  EXPECT_EQ(*indexer_->indexer->NumSlots(4, 0), 703);

  // Pending: another step or a continue waits for Commit; a bad count is OUT_OF_RANGE.
  EXPECT_EQ(Step({{4, 1}}, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Commit(4, 3).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Commit(4, -1).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Commit(5, 0).error_code(), grpc::StatusCode::FAILED_PRECONDITION);  // 1 row: none

  ASSERT_TRUE(Commit(4, 1).ok());
  ASSERT_TRUE(twin_->Commit(4, 1).ok());
  EXPECT_EQ(Info().kv_used_slots(), 702 + 801);
  EXPECT_EQ(*indexer_->indexer->NumSlots(4, 0), 702);
  EXPECT_EQ(Commit(4, 0).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  ASSERT_TRUE(Step({{4, 2}}, &response).ok());
  EXPECT_EQ(response.sequences(0).first_position(), 702);
  ExpectAttended(4, 702, 2, TwinStep(4, 702, 2));
  ASSERT_TRUE(Commit(4, 0).ok());
  ASSERT_TRUE(twin_->Commit(4, 0).ok());
  ASSERT_TRUE(Step({{4, 1}}, &response).ok());
  EXPECT_EQ(response.sequences(0).first_position(), 703);
  ExpectAttended(4, 703, 1, TwinStep(4, 703, 1));

  // Released as a prefix donor in the middle of a speculative step: the indexer keeps row 0 and
  // the sequence can donate.
  ASSERT_TRUE(Step({{4, 4}}, &response).ok());
  ASSERT_TRUE(Release(4, /*keep_indexer_sequence=*/true).ok());
  EXPECT_EQ(*indexer_->indexer->NumSlots(4, 0), 705);
  av1::PrefillRequest shared = PrefillRequest(6, 700);
  shared.set_prefix_source_id(4);
  shared.set_prefix_slots(640);
  MustPrefill(shared);
  EXPECT_EQ(Info().kv_used_slots(), 700 + 801);
}

TEST_F(AttentionServiceTest, PrefixSharingReusesTheDonorsBlocks) {
  Start(/*indexer_blocks=*/1024);
  const std::vector<uint64_t> donor_ids = {1, 2, 3, 4};
  MustPrefill(PrefillRequest(10, 1600, donor_ids));
  av1::PrefillRequest request = PrefillRequest(11, 1200, {1, 2, 3});
  request.set_prefix_source_id(10);
  request.set_prefix_slots(1024);
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(request, &prefilled).ok());
  EXPECT_EQ(prefilled.slots(), 1200);
  EXPECT_EQ(prefilled.slots_appended(), 176);
  // 3 full layers x 16 shared 64-slot blocks.
  EXPECT_EQ(indexer_->Load().shared_blocks(), 48);
  // The shared keys are the ones a prefill from scratch computes.
  TwinPrefill(11, 1200, {1, 2, 3});
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{11, 1}}, &response).ok());
  ExpectAttended(11, 1200, 1, TwinStep(11, 1200, 1, {1, 2, 3}));

  // A donor kept on the indexer after its KV is dropped still shares.
  ASSERT_TRUE(Release(10, /*keep_indexer_sequence=*/true).ok());
  EXPECT_EQ(indexer_->Load().sequences(), 2);
  av1::PrefillRequest again = PrefillRequest(12, 1100, {1, 2, 3});
  again.set_prefix_source_id(10);
  again.set_prefix_slots(1024);
  ASSERT_TRUE(Prefill(again, &prefilled).ok());
  EXPECT_EQ(prefilled.slots_appended(), 76);
  EXPECT_EQ(Info().sequences(), 2);
  ASSERT_TRUE(Release(12).ok());
  EXPECT_EQ(indexer_->Load().sequences(), 2);  // 10 (kept) and 11
}

TEST_F(AttentionServiceTest, ContinueSequenceAppendsTheNewTurnAndResetsTheEmas) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(20, 600, {5, 6}));
  TwinPrefill(20, 600, {5, 6});
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{20, 1}}, &response).ok());
  ExpectAttended(20, 600, 1, TwinStep(20, 600, 1, {5, 6}));

  av1::PrefillRequest request = PrefillRequest(20, 900, {5, 6});
  request.set_continue_sequence(true);
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(request, &prefilled).ok());
  EXPECT_EQ(prefilled.slots(), 900);
  EXPECT_EQ(prefilled.slots_appended(), 299);
  EXPECT_EQ(*indexer_->indexer->NumSlots(20, 2), 900);
  for (int f = 0; f < 3; ++f) {
    ASSERT_TRUE(twin_->AppendIndexKeys(20, f, ReferenceKeys(f, {5, 6}, 601, 299), 299).ok());
  }
  ASSERT_TRUE(twin_->BeginTurn(20).ok());
  ASSERT_TRUE(Step({{20, 1}}, &response).ok());
  ExpectAttended(20, 900, 1, TwinStep(20, 900, 1, {5, 6}));
  EXPECT_EQ(response.sequences(0).blocks_scored(), response.sequences(0).blocks_visible());

  request.set_context_length(800);  // shorter than the sequence
  EXPECT_EQ(Prefill(request, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  request.set_sequence_id(99);
  request.set_context_length(1000);
  EXPECT_EQ(Prefill(request, &prefilled).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(AttentionServiceTest, BadRequestsArePreciseAndLeaveOtherSequencesServing) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(30, 700));
  TwinPrefill(30, 700);
  av1::PrefillResponse prefilled;
  av1::DecodeStepResponse response;

  EXPECT_EQ(Prefill(PrefillRequest(30, 500), &prefilled).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Prefill(PrefillRequest(31, 0), &prefilled).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Prefill(PrefillRequest(31, 600, {1, 2, 3}), &prefilled).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // 3 ids > ceil(600 / 512)
  av1::PrefillRequest bad_prefix = PrefillRequest(31, 600);
  bad_prefix.set_prefix_source_id(30);
  bad_prefix.set_prefix_slots(100);  // not a multiple of 64
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_prefix.set_prefix_slots(640);  // beyond the context
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_prefix.set_prefix_source_id(77);  // unknown source: the indexer's NOT_FOUND
  bad_prefix.set_prefix_slots(512);
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::NOT_FOUND);
  av1::PrefillRequest no_top_k = PrefillRequest(31, 600);
  no_top_k.mutable_settings()->set_top_k(0);
  EXPECT_EQ(Prefill(no_top_k, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  av1::PrefillRequest bad_spin = PrefillRequest(31, 600);
  bad_spin.mutable_settings()->mutable_spin()->set_target_block_sparsity(1.5);
  EXPECT_EQ(Prefill(bad_spin, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  av1::PrefillRequest wide = PrefillRequest(31, 600);
  wide.mutable_settings()->set_top_k(kMaxTopK + 1);  // above what the backends take
  const grpc::Status wide_status = Prefill(wide, &prefilled);
  EXPECT_EQ(wide_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(wide_status.error_message().find("(kMaxTopK)"), std::string::npos);
  // An indexer address that is not host:port is refused before anything is dialed (it was
  // UNKNOWN from the channel before).
  for (const char* address : {"no-port", "host:0", "host:99999", "two words:50052", "::1:50052"}) {
    av1::PrefillRequest bad_address = PrefillRequest(31, 600);
    bad_address.set_indexer_worker(address);
    const grpc::Status status = Prefill(bad_address, &prefilled);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << address;
    EXPECT_EQ(status.error_message().rfind("indexer_worker: ", 0), 0u) << status.error_message();
  }

  EXPECT_EQ(Step({{99, 1}}, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Step({{30, 1}, {99, 1}}, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Step({{30, 0}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({{30, 6}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({{30, 1}, {30, 1}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Commit(99, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Release(99).error_code(), grpc::StatusCode::NOT_FOUND);

  // Nothing of those is left behind, and the good sequence steps on.
  EXPECT_EQ(indexer_->Load().sequences(), 1);
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 700);
  ASSERT_TRUE(Step({{30, 1}}, &response).ok());
  ExpectAttended(30, 700, 1, TwinStep(30, 700, 1));
  ASSERT_TRUE(Release(30).ok());
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(indexer_->Load().used_blocks(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(Release(30).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(AttentionServiceTest, IndexerShapeMismatchAndUnreachableIndexerCreateNothing) {
  Start(/*indexer_blocks=*/512);
  auto other = StartIndexer(512, /*num_heads=*/4, /*head_dim=*/kD);
  av1::PrefillResponse prefilled;
  av1::PrefillRequest request = PrefillRequest(40, 600);
  request.set_indexer_worker(other->address);
  const grpc::Status mismatch = Prefill(request, &prefilled);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(mismatch.error_message().find("H = 4"), std::string::npos) << mismatch.error_message();
  EXPECT_EQ(other->Load().sequences(), 0);

  // A port where nothing listens (a server started and stopped).
  auto gone = StartIndexer(16);
  const std::string gone_address = gone->address;
  gone->server->Shutdown();
  gone.reset();
  request.set_indexer_worker(gone_address);
  const grpc::Status unreachable = Prefill(request, &prefilled);
  EXPECT_EQ(unreachable.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(unreachable.error_message().find(gone_address), std::string::npos)
      << unreachable.error_message();

  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  // The id is free again.
  ASSERT_TRUE(Prefill(PrefillRequest(40, 600), &prefilled).ok());
  other->server->Shutdown();
}

TEST_F(AttentionServiceTest, KvCapacityIsResourceExhaustedWithNothingLeftOnTheIndexer) {
  Start(/*indexer_blocks=*/512, "FSFSFS", 1, /*kv_capacity_slots=*/1500);
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(PrefillRequest(50, 1000), &prefilled).ok());
  TwinPrefill(50, 1000);
  const iv1::GetLoadResponse before = indexer_->Load();
  EXPECT_EQ(Prefill(PrefillRequest(51, 501), &prefilled).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  const iv1::GetLoadResponse after = indexer_->Load();
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.used_blocks(), before.used_blocks());
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 1000);
  // Exactly full is fine; a step past the capacity is refused and changes nothing.
  ASSERT_TRUE(Prefill(PrefillRequest(51, 500), &prefilled).ok());
  av1::DecodeStepResponse response;
  EXPECT_EQ(Step({{50, 1}}, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(*indexer_->indexer->NumSlots(50, 0), 1000);
  ASSERT_TRUE(Release(51).ok());
  ASSERT_TRUE(Step({{50, 1}}, &response).ok());
  ExpectAttended(50, 1000, 1, TwinStep(50, 1000, 1));
}

TEST_F(AttentionServiceTest, IndexKeyCacheFullDuringPrefillOrStep) {
  // 3 full layers; 1536 slots = 24 blocks a layer, 72 in all; 64 slots = 3 blocks.
  Start(/*indexer_blocks=*/76);
  av1::PrefillResponse prefilled;
  // 2000 slots need 96 blocks: the append fails and the created sequence is released again.
  EXPECT_EQ(Prefill(PrefillRequest(60, 2000), &prefilled).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(indexer_->Load().used_blocks(), 0);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);

  ASSERT_TRUE(Prefill(PrefillRequest(60, 1536), &prefilled).ok());
  ASSERT_TRUE(Prefill(PrefillRequest(61, 64), &prefilled).ok());
  TwinPrefill(60, 1536);
  EXPECT_EQ(indexer_->Load().free_blocks(), 1);
  // Slot 1536 starts a new block in each of the 3 layers: the first full layer takes the last
  // free block and selects (the indexer has advanced it), the second cannot append: the step
  // fails and sequence 60 is broken.
  av1::DecodeStepResponse response;
  const grpc::Status failed = Step({{60, 1}}, &response);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(failed.error_message().find("broken"), std::string::npos) << failed.error_message();
  EXPECT_EQ(Info().kv_used_slots(), 1536 + 64);
  const grpc::Status broken = Step({{60, 1}}, &response);
  EXPECT_EQ(broken.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(broken.error_message().find("broken"), std::string::npos);
  // The other sequence is untouched: its step fails at the first layer's append (no free
  // block, nothing applied) without breaking it, then succeeds once there is room.
  EXPECT_EQ(Step({{61, 1}}, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(Release(60).ok());
  TwinPrefill(61, 64);
  ASSERT_TRUE(Step({{61, 1}}, &response).ok());
  ExpectAttended(61, 64, 1, TwinStep(61, 64, 1));
}

TEST_F(AttentionServiceTest, OneStepBatchesSequencesOfTwoIndexerWorkers) {
  Start(/*indexer_blocks=*/512);
  auto second = StartIndexer(512);
  MustPrefill(PrefillRequest(70, 800));
  av1::PrefillRequest request = PrefillRequest(71, 650, {3, 4});
  request.set_indexer_worker(second->address);
  MustPrefill(request);
  EXPECT_EQ(indexer_->Load().sequences(), 1);
  EXPECT_EQ(second->Load().sequences(), 1);
  TwinPrefill(70, 800);
  TwinPrefill(71, 650, {3, 4});
  for (int step = 0; step < 2; ++step) {
    av1::DecodeStepResponse response;
    ASSERT_TRUE(Step({{71, 2}, {70, 1}}, &response).ok());
    EXPECT_EQ(response.sequences(0).sequence_id(), 71u);
    EXPECT_EQ(response.sequences(1).sequence_id(), 70u);
    ExpectAttended(71, 650 + step, 2, TwinStep(71, 650 + step, 2, {3, 4}));
    ExpectAttended(70, 800 + step, 1, TwinStep(70, 800 + step, 1));
    ASSERT_TRUE(Commit(71, 0).ok());
    ASSERT_TRUE(twin_->Commit(71, 0).ok());
  }
  EXPECT_EQ(*second->indexer->NumSlots(71, 1), 652);
  ASSERT_TRUE(Release(71).ok());
  EXPECT_EQ(second->Load().sequences(), 0);
  service_->CloseTransports();  // half-closes the select streams, so the server can stop
  second->server->Shutdown();
}

TEST_F(AttentionServiceTest, PrefillOfOneSequenceRunsBesideStepsOfOthers) {
  Start(/*indexer_blocks=*/2048);
  MustPrefill(PrefillRequest(80, 700));
  MustPrefill(PrefillRequest(81, 900));
  TwinPrefill(80, 700);
  TwinPrefill(81, 900);
  // Steps of 80 and 81 (two callers, one batch each) while 82 prefills 30000 slots.
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(3);
  threads.emplace_back([&] {
    av1::PrefillResponse response;
    statuses[0] = Prefill(PrefillRequest(82, 30000), &response);
  });
  for (int s = 0; s < 2; ++s) {
    threads.emplace_back([&, s] {
      for (int step = 0; step < 5 && statuses[1 + s].ok(); ++step) {
        av1::DecodeStepResponse response;
        statuses[1 + s] = Step({{80u + s, 1}}, &response);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const grpc::Status& status : statuses) EXPECT_TRUE(status.ok()) << status.error_message();
  for (int step = 0; step < 5; ++step) {
    ExpectAttended(80, 700 + step, 1, TwinStep(80, 700 + step, 1));
    ExpectAttended(81, 900 + step, 1, TwinStep(81, 900 + step, 1));
  }
  EXPECT_EQ(*indexer_->indexer->NumSlots(82, 2), 30000);
  EXPECT_EQ(Info().kv_used_slots(), 705 + 905 + 30000);
}

// A prefill whose caller gave up while it ran leaves nothing behind: the worker runs it to its
// end, then drops the sequence on itself and on the indexer, since the caller's Release may have
// come before the sequence existed. The prefill is held mid-way (PrefillHold) until the worker's
// side of the call is cancelled, so the cancellation always lands while it runs.
TEST_F(AttentionServiceTest, APrefillItsCallerCancelledLeavesNothingBehind) {
  PrefillHold hold;
  hold_ = &hold;
  prefill_calls_owned_ = std::make_unique<PrefillCalls>();
  prefill_calls_ = prefill_calls_owned_.get();
  Start(/*indexer_blocks=*/512);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::Status status;
  std::thread caller([&] {
    av1::PrefillResponse response;
    status = stub_->Prefill(&context, PrefillRequest(5, 4000), &response);
  });
  // Whatever fails below, the prefill ends and the caller returns.
  struct Cleanup {
    std::function<void()> run;
    ~Cleanup() { run(); }
  } cleanup{[&] {
    context.TryCancel();
    if (!hold.release.HasBeenNotified()) hold.release.Notify();
    if (caller.joinable()) caller.join();
  }};
  ASSERT_TRUE(hold.entered.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // Mid-way: the sequence exists on both workers, its KV is held.
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 4000);
  EXPECT_EQ(indexer_->Load().sequences(), 1);
  context.TryCancel();
  caller.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  // The worker sees the cancellation only when its transport has read it; the sync API has no
  // event for that, so the held prefill goes on once IsCancelled() says so.
  grpc::ServerContextBase* server_context = prefill_calls_->context();
  ASSERT_NE(server_context, nullptr);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!server_context->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(server_context->IsCancelled());
  hold.release.Notify();
  ASSERT_TRUE(prefill_calls_->answered.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // The prefill ran to its end (its duration recorded), then what it made was dropped.
  EXPECT_EQ(prefill_calls_->status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(prefill_calls_->status.error_message(),
            "the caller cancelled the prefill: what it made was released");
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_prefill_duration_seconds", "", ""), 1);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0u);
}

TEST_F(AttentionServiceTest, IndexerGoneDuringDecodeIsUnavailable) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(90, 700));
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{90, 1}}, &response).ok());
  // The indexer stops (its select stream cancelled after 100 ms).
  indexer_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  const grpc::Status gone = Step({{90, 1}}, &response);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::UNAVAILABLE) << gone.error_message();
  EXPECT_NE(gone.error_message().find(indexer_->address), std::string::npos)
      << gone.error_message();
  EXPECT_EQ(Info().kv_used_slots(), 701);  // the failed step's KV rows are gone
  // Release drops the KV even though the indexer cannot be told.
  const grpc::Status released = Release(90);
  EXPECT_EQ(released.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0u);  // nor is its owner kept
}

TEST_F(AttentionServiceTest, AuditedRowsAndMissRatesAreSummedOverTheFullLayers) {
  audit_fraction_ = 1.0;  // every pruned select is audited
  Start(/*indexer_blocks=*/512, "FSFSFSFS");
  MustPrefill(PrefillRequest(95, 1500));
  TwinPrefill(95, 1500);
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{95, 1}}, &response).ok());  // warm-up: every block, nothing to audit
  EXPECT_EQ(response.sequences(0).audited_rows(), 0);
  ExpectAttended(95, 1500, 1, TwinStep(95, 1500, 1));
  double miss_rate_sum = 0;
  for (int step = 0; step < 3; ++step) {
    const int64_t t = 1501 + step;
    ASSERT_TRUE(Step({{95, 1}}, &response).ok());  // pruned: one row audited in each of 4 layers
    std::vector<double> miss_rates;
    ExpectAttended(95, t, 1, TwinStep(95, t, 1, {}, &miss_rates));
    EXPECT_LT(response.sequences(0).blocks_scored(), response.sequences(0).blocks_visible());
    ASSERT_EQ(miss_rates.size(), 4u);
    EXPECT_EQ(response.sequences(0).audited_rows(), 4);
    double expected = 0;
    for (double rate : miss_rates) expected += rate;
    EXPECT_DOUBLE_EQ(response.sequences(0).audit_miss_rate_sum(), expected);
    miss_rate_sum += expected;
  }
  ASSERT_TRUE(Step({{95, 3}}, &response).ok());  // verifier rows: 3 audited rows a layer
  EXPECT_EQ(response.sequences(0).audited_rows(), 12);
  EXPECT_GE(response.sequences(0).audit_miss_rate_sum(), 0.0);
  EXPECT_LE(response.sequences(0).audit_miss_rate_sum(), 12.0);
  EXPECT_GT(miss_rate_sum, 0.0);  // these seeded inputs do lose a few slots (0.39 over 12 rows)
}

}  // namespace
}  // namespace dsa
