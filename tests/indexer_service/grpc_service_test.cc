// Tests of the gRPC adapter (indexer_service/grpc_service.h) against an in-process server on
// 127.0.0.1:0: a full flow whose selections equal a twin engine called directly with the same
// values, and bad input answered with the precise status while the server keeps serving and a
// failed multi-chunk append leaves nothing behind.
#include "indexer_service/grpc_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "proto/tensor_codec.h"
#include "server/parse_errors.h"
#include "tests/testing/raw_call.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::indexer::v1;
using ::dsa::common::v1::DType;
using ::dsa::common::v1::Tensor;

constexpr int kH = 4, kD = 16, kK = 64;

std::vector<float> RandomValues(std::mt19937& rng, size_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = normal(rng);
  return v;
}

// One row group's inputs as the engine sees them (decoded) and as the wire carries them.
struct Rows {
  std::vector<float> queries;  // fp32 [rows, H, D], the decoded values
  std::vector<float> weights;  // fp32 [rows, H]
  Tensor query_tensor;
  Tensor weight_tensor;
};

// Queries in `dtype`: fp32 as is, bf16 with values that bf16 holds exactly, fp8 from random codes.
Rows MakeRows(std::mt19937& rng, int num_rows, DType dtype) {
  Rows rows;
  const size_t n = static_cast<size_t>(num_rows) * kH * kD;
  rows.queries = RandomValues(rng, n);
  std::string bytes;
  if (dtype == common::v1::DTYPE_BFLOAT16) {
    bytes.resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &rows.queries[i], 4);
      bits &= 0xffff0000u;
      std::memcpy(&rows.queries[i], &bits, 4);
      const auto half = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&bytes[2 * i], &half, 2);
    }
  } else if (dtype == common::v1::DTYPE_FLOAT8_E4M3FN) {
    bytes.resize(n);
    std::uniform_int_distribution<int> code(0, 255);
    for (size_t i = 0; i < n; ++i) {
      uint8_t c;
      do {
        c = static_cast<uint8_t>(code(rng));
      } while (!std::isfinite(Fp8E4m3DecodeTable()[c]) || std::abs(Fp8E4m3DecodeTable()[c]) > 4);
      rows.queries[i] = Fp8E4m3DecodeTable()[c];
      bytes[i] = static_cast<char>(c);
    }
  }
  const int64_t query_shape[] = {num_rows, kH, kD};
  if (dtype == common::v1::DTYPE_FLOAT32) {
    EncodeFloatTensor(rows.queries, query_shape, &rows.query_tensor);
  } else {
    rows.query_tensor.set_dtype(dtype);
    for (int64_t e : query_shape) rows.query_tensor.add_shape(e);
    rows.query_tensor.set_data(bytes);
  }
  std::uniform_real_distribution<float> positive(0.1f, 1.0f);
  rows.weights.resize(static_cast<size_t>(num_rows) * kH);
  for (float& w : rows.weights) w = positive(rng);
  const int64_t weight_shape[] = {num_rows, kH};
  EncodeFloatTensor(rows.weights, weight_shape, &rows.weight_tensor);
  return rows;
}

std::vector<IndexerRow> EngineRows(const Rows& rows, int64_t first_position) {
  const size_t num_rows = rows.weights.size() / kH;
  std::vector<IndexerRow> out(num_rows);
  for (size_t r = 0; r < num_rows; ++r) {
    out[r].query = std::span<const float>(rows.queries.data() + r * kH * kD, kH * kD);
    out[r].head_weights = std::span<const float>(rows.weights.data() + r * kH, kH);
    out[r].position = first_position + static_cast<int64_t>(r);
  }
  return out;
}

void AddGroup(v1::SelectRequest* request, uint64_t id, int layer, int64_t first_position,
              const Rows& rows) {
  v1::RowGroup* group = request->add_groups();
  group->set_sequence_id(id);
  group->set_layer(layer);
  group->set_first_position(first_position);
  *group->mutable_queries() = rows.query_tensor;
  *group->mutable_head_weights() = rows.weight_tensor;
}

std::vector<int32_t> Selections(const v1::GroupSelection& selection) {
  auto values = DecodeInt32Tensor(selection.selections(), std::vector<int64_t>{-1, kK}, "sel");
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<int32_t>{};
}

v1::CreateSequenceRequest CreateRequest(uint64_t id, int num_layers, double rho) {
  v1::CreateSequenceRequest request;
  request.set_sequence_id(id);
  request.set_num_layers(num_layers);
  request.set_top_k(kK);
  request.mutable_spin()->set_target_block_sparsity(rho);
  request.mutable_spin()->set_seed(7);
  return request;
}

SequenceOptions EngineOptions(int num_layers, double rho) {
  SequenceOptions options;
  options.num_layers = num_layers;
  options.top_k = kK;
  options.spin.target_block_sparsity = rho;
  options.spin.seed = 7;
  return options;
}

// One chunk of an AppendIndexKeys call.
struct Chunk {
  uint64_t sequence_id;
  int layer;
  int64_t first_slot;
  std::vector<float> keys;  // fp32 [num_keys, D]
};

// The value of one sample of the registry: family `name` with the given label (empty = none);
// histograms give their sample count. -1 when absent.
double MetricValue(prometheus::Registry& registry, const std::string& name,
                   const std::string& label_value = "") {
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      const bool match = label_value.empty()
                             ? metric.label.empty()
                             : (metric.label.size() == 1 && metric.label[0].value == label_value);
      if (!match) continue;
      switch (family.type) {
        case prometheus::MetricType::Counter:
          return metric.counter.value;
        case prometheus::MetricType::Gauge:
          return metric.gauge.value;
        case prometheus::MetricType::Histogram:
          return static_cast<double>(metric.histogram.sample_count);
        default:
          return -1;
      }
    }
  }
  return -1;
}

class GrpcServiceTest : public ::testing::Test {
 protected:
  void StartServer(int64_t capacity_blocks) {
    auto indexer = Indexer::Create({capacity_blocks, kH, kD});
    ASSERT_TRUE(indexer.ok()) << indexer.status();
    indexer_ = std::move(*indexer);
    auto twin = Indexer::Create({capacity_blocks, kH, kD});
    ASSERT_TRUE(twin.ok());
    twin_ = std::move(*twin);
    registry_ = std::make_shared<prometheus::Registry>();
    metrics_ = std::make_unique<IndexerMetrics>(*registry_);
    service_ = std::make_unique<IndexerServiceImpl>(indexer_.get(), metrics_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
    AddServerInterceptors(builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = v1::IndexerService::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  grpc::Status Create(const v1::CreateSequenceRequest& request) {
    grpc::ClientContext context;
    v1::CreateSequenceResponse response;
    return stub_->CreateSequence(&context, request, &response);
  }

  grpc::Status Append(const std::vector<Chunk>& chunks, int64_t* keys_appended = nullptr) {
    grpc::ClientContext context;
    v1::AppendIndexKeysResponse response;
    auto writer = stub_->AppendIndexKeys(&context, &response);
    for (const Chunk& chunk : chunks) {
      v1::AppendIndexKeysRequest request;
      request.set_sequence_id(chunk.sequence_id);
      request.set_layer(chunk.layer);
      request.set_first_slot(chunk.first_slot);
      const int64_t shape[] = {static_cast<int64_t>(chunk.keys.size()) / kD, kD};
      EncodeFloatTensor(chunk.keys, shape, request.mutable_keys());
      if (!writer->Write(request)) break;  // the server ended the call early
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (keys_appended != nullptr) *keys_appended = response.keys_appended();
    return status;
  }

  // Appends `keys` to (id, layer) on the server in chunks of `chunk_keys` and in one go on the
  // twin.
  void AppendBoth(uint64_t id, int layer, const std::vector<float>& keys, int64_t chunk_keys) {
    const int64_t num_keys = static_cast<int64_t>(keys.size()) / kD;
    const int64_t first = *twin_->NumSlots(id, layer);
    std::vector<Chunk> chunks;
    for (int64_t k = 0; k < num_keys; k += chunk_keys) {
      const int64_t n = std::min(chunk_keys, num_keys - k);
      chunks.push_back({id, layer, first + k,
                        std::vector<float>(keys.begin() + k * kD, keys.begin() + (k + n) * kD)});
    }
    int64_t appended = 0;
    ASSERT_TRUE(Append(chunks, &appended).ok());
    EXPECT_EQ(appended, num_keys);
    ASSERT_TRUE(twin_->AppendIndexKeys(id, layer, keys, num_keys).ok());
  }

  grpc::Status Select(const v1::SelectRequest& request, v1::SelectResponse* response) {
    grpc::ClientContext context;
    return stub_->Select(&context, request, response);
  }

  grpc::Status Commit(uint64_t id, int accepted) {
    grpc::ClientContext context;
    v1::CommitRequest request;
    request.set_sequence_id(id);
    request.set_accepted(accepted);
    v1::CommitResponse response;
    return stub_->Commit(&context, request, &response);
  }

  v1::GetLoadResponse Load() {
    grpc::ClientContext context;
    v1::GetLoadResponse response;
    EXPECT_TRUE(stub_->GetLoad(&context, v1::GetLoadRequest(), &response).ok());
    return response;
  }

  // One row at `position` selected over gRPC equals the same row selected on the twin engine.
  void ExpectOneRowSelectMatchesTwin(std::mt19937& rng, DType dtype, uint64_t sequence, int layer,
                                     int64_t position) {
    const Rows rows = MakeRows(rng, 1, dtype);
    v1::SelectRequest request;
    AddGroup(&request, sequence, layer, position, rows);
    v1::SelectResponse response;
    ASSERT_TRUE(Select(request, &response).ok());
    auto expected = twin_->Select(sequence, layer, EngineRows(rows, position));
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Selections(response.selections(0)), expected->selections);
  }

  std::unique_ptr<Indexer> indexer_;  // behind the server
  std::unique_ptr<Indexer> twin_;     // called directly with the same values
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<IndexerMetrics> metrics_;
  std::unique_ptr<IndexerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::IndexerService::Stub> stub_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST(ToGrpcStatusTest, SameCodeAndMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const grpc::Status s = ToGrpcStatus(absl::ResourceExhaustedError("pool full"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "pool full");
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcServiceTest, FullFlowEqualsTheEngine) {
  StartServer(256);
  constexpr int kLayers = 2;
  constexpr int64_t kContext = 700;  // > K: SPIN prunes after the warm-up
  std::mt19937 rng(3);
  for (uint64_t id : {11u, 12u}) {
    ASSERT_TRUE(Create(CreateRequest(id, kLayers, 0.4)).ok());
    ASSERT_TRUE(twin_->CreateSequence(id, EngineOptions(kLayers, 0.4)).ok());
    for (int l = 0; l < kLayers; ++l) {
      AppendBoth(id, l, RandomValues(rng, kContext * kD), 128);
    }
  }
  EXPECT_EQ(Load().sequences(), 2);
  EXPECT_EQ(Load().used_blocks(), twin_->Usage().used_blocks);

  // Decode steps: one request carries both sequences (one group each), every dtype of query.
  int64_t position = kContext;
  int pruned_groups = 0;  // groups where SPIN skipped blocks (so the flow covers the sparse path)
  int64_t blocks_scored = 0, blocks_visible = 0, groups = 0;
  const DType dtypes[] = {common::v1::DTYPE_FLOAT32, common::v1::DTYPE_BFLOAT16,
                          common::v1::DTYPE_FLOAT8_E4M3FN};
  for (int step = 0; step < 4; ++step, ++position) {
    for (int l = 0; l < kLayers; ++l) {
      v1::SelectRequest request;
      request.set_request_id(100 + step);
      std::vector<Rows> rows;
      for (uint64_t id : {11u, 12u}) {
        AppendBoth(id, l, RandomValues(rng, kD), 1);
        rows.push_back(MakeRows(rng, 1, dtypes[(step + id) % 3]));
        AddGroup(&request, id, l, position, rows.back());
      }
      v1::SelectResponse response;
      ASSERT_TRUE(Select(request, &response).ok());
      EXPECT_EQ(response.request_id(), 100u + step);
      ASSERT_EQ(response.selections_size(), 2);
      for (int g = 0; g < 2; ++g) {
        auto expected = twin_->Select(11 + g, l, EngineRows(rows[g], position));
        ASSERT_TRUE(expected.ok());
        EXPECT_EQ(Selections(response.selections(g)), expected->selections)
            << "step " << step << " layer " << l << " group " << g;
        EXPECT_EQ(response.selections(g).blocks_scored(), expected->blocks_scored);
        EXPECT_EQ(response.selections(g).blocks_visible(), expected->blocks_visible);
        EXPECT_EQ(response.selections(g).all_blocks(), expected->all_blocks);
        pruned_groups += expected->blocks_scored < expected->blocks_visible ? 1 : 0;
        blocks_scored += expected->blocks_scored;
        blocks_visible += expected->blocks_visible;
        ++groups;
      }
    }
  }
  EXPECT_GT(pruned_groups, 0);
  // Metrics: one observation per group; block counters sum the groups; cache gauges follow usage.
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_blocks_scored_total"), blocks_scored);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_blocks_visible_total"), blocks_visible);
  for (const char* phase : {"predict", "scan", "topk", "update"}) {
    EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_select_duration_seconds", phase), groups)
        << phase;
  }
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_cache_blocks", "exclusive"),
            twin_->Usage().used_blocks - twin_->Usage().shared_blocks);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_cache_blocks", "shared"),
            twin_->Usage().shared_blocks);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_cache_blocks", "free"),
            twin_->Usage().free_blocks);
  // A CPU engine: every group is counted as scored on the CPU.
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_selects_total", "cpu"), groups);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_selects_total", "device"), 0);

  // A speculative step of sequence 11 (draft length 2, three verifier rows per layer), commit 1.
  for (int l = 0; l < kLayers; ++l) {
    AppendBoth(11, l, RandomValues(rng, 3 * kD), 2);
    const Rows rows = MakeRows(rng, 3, common::v1::DTYPE_BFLOAT16);
    v1::SelectRequest request;
    AddGroup(&request, 11, l, position, rows);
    v1::SelectResponse response;
    ASSERT_TRUE(Select(request, &response).ok());
    auto expected = twin_->Select(11, l, EngineRows(rows, position));
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Selections(response.selections(0)), expected->selections) << "verifier layer " << l;
  }
  ASSERT_TRUE(Commit(11, 1).ok());
  ASSERT_TRUE(twin_->Commit(11, 1).ok());
  EXPECT_EQ(*indexer_->NumSlots(11, 0), position + 2);
  position += 2;

  // Per-layer traffic over SelectStream after the commit: one response per request, in order.
  {
    grpc::ClientContext context;
    auto stream = stub_->SelectStream(&context);
    std::vector<Rows> rows;
    for (int l = 0; l < kLayers; ++l) {
      AppendBoth(11, l, RandomValues(rng, kD), 1);
      rows.push_back(MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
      v1::SelectRequest request;
      request.set_request_id(500 + l);
      AddGroup(&request, 11, l, position, rows.back());
      ASSERT_TRUE(stream->Write(request));
    }
    for (int l = 0; l < kLayers; ++l) {
      v1::SelectResponse response;
      ASSERT_TRUE(stream->Read(&response));
      EXPECT_EQ(response.request_id(), 500u + l);
      auto expected = twin_->Select(11, l, EngineRows(rows[l], position));
      ASSERT_TRUE(expected.ok());
      EXPECT_EQ(Selections(response.selections(0)), expected->selections) << "stream layer " << l;
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }

  // BeginTurn then release both; the pool is empty again.
  {
    grpc::ClientContext context;
    v1::BeginTurnRequest request;
    request.set_sequence_id(11);
    v1::BeginTurnResponse response;
    EXPECT_TRUE(stub_->BeginTurn(&context, request, &response).ok());
  }
  for (uint64_t id : {11u, 12u}) {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.set_sequence_id(id);
    v1::ReleaseResponse response;
    EXPECT_TRUE(stub_->Release(&context, request, &response).ok());
  }
  const v1::GetLoadResponse load = Load();
  EXPECT_EQ(load.sequences(), 0);
  EXPECT_EQ(load.used_blocks(), 0);
  EXPECT_EQ(load.capacity_blocks(), 256);
  EXPECT_EQ(load.free_blocks(), 256);
  EXPECT_EQ(load.num_heads(), kH);
  EXPECT_EQ(load.head_dim(), kD);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_cache_blocks", "exclusive"), 0);
  EXPECT_EQ(MetricValue(*registry_, "dsa_indexer_cache_blocks", "free"), 256);
}

TEST_F(GrpcServiceTest, BadInputGetsThePreciseStatusAndTheServerKeepsServing) {
  StartServer(8);  // 512 slots in all
  std::mt19937 rng(5);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 100 * kD), 40);
  const v1::GetLoadResponse before = Load();

  // Duplicate: ALREADY_EXISTS with the engine's own message.
  const grpc::Status duplicate = Create(CreateRequest(1, 1, 0.4));
  EXPECT_EQ(duplicate.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(duplicate.error_message(), twin_->CreateSequence(1, EngineOptions(1, 0.4)).message());
  // Bad settings and unknown enum values: INVALID_ARGUMENT.
  v1::CreateSequenceRequest bad_create = CreateRequest(2, 1, 1.5);
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_create = CreateRequest(2, 1, 0.4);
  bad_create.mutable_spin()->set_pooling(static_cast<v1::BlockPooling>(42));
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_create = CreateRequest(2, 0, 0.4);
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Unknown sequence: NOT_FOUND from every RPC.
  EXPECT_EQ(Append({{99, 0, 0, RandomValues(rng, kD)}}).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Commit(99, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  {
    v1::SelectRequest request;
    AddGroup(&request, 99, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
    v1::SelectResponse response;
    EXPECT_EQ(Select(request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
    grpc::ClientContext context;
    v1::ReleaseRequest release;
    release.set_sequence_id(99);
    v1::ReleaseResponse released;
    EXPECT_EQ(stub_->Release(&context, release, &released).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  // Queries of the wrong dtype or shape, head weights not fp32, NaN in a query, no groups,
  // a row whose key is not appended yet.
  auto select_status = [&](const v1::SelectRequest& request) {
    v1::SelectResponse response;
    return Select(request, &response).error_code();
  };
  {
    Rows rows = MakeRows(rng, 1, common::v1::DTYPE_FLOAT32);
    v1::SelectRequest request;
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_queries()->set_dtype(common::v1::DTYPE_INT32);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);
    request.mutable_groups(0)->mutable_queries()->set_dtype(common::v1::DTYPE_UNSPECIFIED);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    const Rows wide = [&] {
      Rows r;
      r.queries = RandomValues(rng, kH * (kD + 1));
      EncodeFloatTensor(r.queries, std::vector<int64_t>{1, kH, kD + 1}, &r.query_tensor);
      r.weight_tensor = rows.weight_tensor;
      return r;
    }();
    request.Clear();
    AddGroup(&request, 1, 0, 99, wide);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_queries()->mutable_data()->resize(kH * kD * 4 - 1);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_head_weights()->set_dtype(common::v1::DTYPE_BFLOAT16);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    Rows nan_rows = rows;
    nan_rows.queries[5] = std::numeric_limits<float>::quiet_NaN();
    EncodeFloatTensor(nan_rows.queries, std::vector<int64_t>{1, kH, kD}, &nan_rows.query_tensor);
    request.Clear();
    AddGroup(&request, 1, 0, 99, nan_rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 100, rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::OUT_OF_RANGE);
    request.Clear();
    AddGroup(&request, 1, 3, 99, rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    // A good group followed by a bad one: the bad one is caught before the good one runs.
    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    AddGroup(&request, 1, 0, 99, wide);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);
    // Commit with nothing pending: FAILED_PRECONDITION.
    EXPECT_EQ(Commit(1, 0).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }

  // NaN in the second chunk of an append: INVALID_ARGUMENT and the first chunk is undone.
  {
    std::vector<float> nan_keys = RandomValues(rng, 10 * kD);
    nan_keys[3 * kD + 1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(Append({{1, 0, 100, RandomValues(rng, 10 * kD)}, {1, 0, 110, nan_keys}}).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(*indexer_->NumSlots(1, 0), 100);
    // A wrong first_slot: FAILED_PRECONDITION; a key of the wrong width: INVALID_ARGUMENT.
    EXPECT_EQ(Append({{1, 0, 101, RandomValues(rng, kD)}}).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    {
      grpc::ClientContext context;
      v1::AppendIndexKeysResponse response;
      auto writer = stub_->AppendIndexKeys(&context, &response);
      v1::AppendIndexKeysRequest request;
      request.set_sequence_id(1);
      request.set_first_slot(100);
      EncodeFloatTensor(RandomValues(rng, 2 * (kD + 1)), std::vector<int64_t>{2, kD + 1},
                        request.mutable_keys());
      writer->Write(request);
      writer->WritesDone();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    }
  }

  // A context beyond capacity: the third chunk does not fit; the two before it are undone.
  EXPECT_EQ(Append({{1, 0, 100, RandomValues(rng, 200 * kD)},
                    {1, 0, 300, RandomValues(rng, 200 * kD)},
                    {1, 0, 500, RandomValues(rng, 200 * kD)}})
                .error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 100);
  const v1::GetLoadResponse after = Load();
  EXPECT_EQ(after.used_blocks(), before.used_blocks());
  EXPECT_EQ(after.free_blocks(), before.free_blocks());
  EXPECT_EQ(after.sequences(), 1);

  // The server keeps serving, and the state equals the twin that never saw the bad requests.
  AppendBoth(1, 0, RandomValues(rng, 300 * kD), 120);
  ExpectOneRowSelectMatchesTwin(rng, common::v1::DTYPE_FLOAT8_E4M3FN, 1, 0, 399);
}

TEST_F(GrpcServiceTest, AChunkOverTheLimitIsRefusedAndNothingIsWritten) {
  StartServer(64);
  std::mt19937 rng(11);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 70 * kD), 70);
  // One good chunk, then one of 5 MiB (over the 4 MiB chunk limit): refused, the first undone
  // before the status reaches the client.
  const int64_t big_keys = (int64_t{5} << 20) / (kD * 4);
  const grpc::Status status = Append({{1, 0, 70, RandomValues(rng, 10 * kD)},
                                      {1, 0, 80, std::vector<float>(big_keys * kD, 0.5f)}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 70);
  EXPECT_EQ(Load().used_blocks(), twin_->Usage().used_blocks);
  AppendBoth(1, 0, RandomValues(rng, 10 * kD), 10);
  ExpectOneRowSelectMatchesTwin(rng, common::v1::DTYPE_FLOAT32, 1, 0, 79);
}

TEST_F(GrpcServiceTest, PrefixSharingThroughCreateSequence) {
  StartServer(32);
  std::mt19937 rng(13);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 150 * kD), 64);
  v1::CreateSequenceRequest shared = CreateRequest(2, 1, 0.4);
  shared.set_prefix_source_id(1);
  shared.set_prefix_slots(128);
  ASSERT_TRUE(Create(shared).ok());
  ASSERT_TRUE(twin_->CreateSequenceFromPrefix(2, EngineOptions(1, 0.4), 1, 128).ok());
  EXPECT_EQ(Load().shared_blocks(), 2);
  EXPECT_EQ(*indexer_->NumSlots(2, 0), 128);
  AppendBoth(2, 0, RandomValues(rng, 10 * kD), 10);
  ExpectOneRowSelectMatchesTwin(rng, common::v1::DTYPE_BFLOAT16, 2, 0, 137);

  // prefix_slots without a source, a length that is not a multiple of 64, an unknown source.
  v1::CreateSequenceRequest bad = CreateRequest(3, 1, 0.4);
  bad.set_prefix_slots(64);
  EXPECT_EQ(Create(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.set_prefix_source_id(1);
  bad.set_prefix_slots(100);
  EXPECT_EQ(Create(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.set_prefix_source_id(77);
  bad.set_prefix_slots(64);
  EXPECT_EQ(Create(bad).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Load().sequences(), 2);
}

TEST_F(GrpcServiceTest, SelectStreamAnswersAFailedRequestWithItsStatusAndGoesOn) {
  StartServer(8);
  std::mt19937 rng(9);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 82 * kD), 82);
  grpc::ClientContext context;
  auto stream = stub_->SelectStream(&context);
  v1::SelectRequest good;
  good.set_request_id(1);
  AddGroup(&good, 1, 0, 79, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(good));
  v1::SelectResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 1u);
  EXPECT_EQ(response.selections_size(), 1);
  EXPECT_FALSE(response.has_error());
  v1::SelectRequest unknown;
  unknown.set_request_id(2);
  AddGroup(&unknown, 42, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(unknown));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 2u);
  EXPECT_EQ(response.selections_size(), 0);
  EXPECT_EQ(response.error().code(), static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  EXPECT_NE(response.error().message().find("42"), std::string::npos) << response.error().message();
  // The same stream still serves the good sequence.
  v1::SelectRequest later;
  later.set_request_id(3);
  AddGroup(&later, 1, 0, 81, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(later));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 3u);
  EXPECT_EQ(response.selections_size(), 1);
  EXPECT_FALSE(response.has_error());
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServiceTest, KAboveTheBackendsLargestIsRefused) {
  StartServer(8);
  v1::CreateSequenceRequest request = CreateRequest(1, 1, 0.4);
  request.set_top_k(kMaxTopK + 1);
  const grpc::Status status = Create(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("top_k must be in [1, 2048] (kMaxTopK), got 2049"),
            std::string::npos)
      << status.error_message();
  request.set_top_k(kMaxTopK);
  EXPECT_TRUE(Create(request).ok());
}

TEST_F(GrpcServiceTest, ASelectWhoseAnswerCouldPassTheMessageLimitIsRefusedBeforeItRuns) {
  StartServer(8);
  std::mt19937 rng(33);
  v1::CreateSequenceRequest create = CreateRequest(1, 1, 0.4);
  create.set_top_k(kMaxTopK);
  ASSERT_TRUE(Create(create).ok());
  ASSERT_TRUE(Append({{1, 0, 0, RandomValues(rng, 64 * kD)}}).ok());
  // 8,200 rows of K = 2,048: 8,200 x 8,200 bytes of selections and rates, over 64 MiB (the
  // request itself is 2.2 MB). Before the limit, SelectStream built such an answer and protobuf
  // aborted the process past 2 GB.
  const int rows = 8200;
  ASSERT_GT(SelectResponseBytesBound(rows, kMaxTopK), kMaxReceiveMessageBytes);
  v1::SelectRequest request;
  AddGroup(&request, 1, 0, 0, MakeRows(rng, rows, common::v1::DTYPE_FLOAT32));
  v1::SelectResponse response;
  const grpc::Status status = Select(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("over the message limit of 67108864 bytes"),
            std::string::npos)
      << status.error_message();
  // Refused before anything ran: the layer selects from its first position as before.
  AddGroup(&request, 1, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  request.mutable_groups()->DeleteSubrange(0, 1);
  EXPECT_TRUE(Select(request, &response).ok());
}

// A chunk's request message, serialized (for raw calls).
std::string ChunkBytes(uint64_t id, int layer, int64_t first_slot, const std::vector<float>& keys) {
  v1::AppendIndexKeysRequest request;
  request.set_sequence_id(id);
  request.set_layer(layer);
  request.set_first_slot(first_slot);
  const int64_t shape[] = {static_cast<int64_t>(keys.size()) / kD, kD};
  EncodeFloatTensor(keys, shape, request.mutable_keys());
  return request.SerializeAsString();
}

TEST_F(GrpcServiceTest, AnUnparseableChunkFailsTheAppendAndUndoesItsChunks) {
  StartServer(8);
  std::mt19937 rng(31);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  const std::vector<std::string> messages = {ChunkBytes(1, 0, 0, RandomValues(rng, 10 * kD)),
                                             testing::UnparseableMessage(),
                                             ChunkBytes(1, 0, 10, RandomValues(rng, 10 * kD))};
  const testing::RawCallResult result =
      testing::RawCall(channel_, "/dsa.indexer.v1.IndexerService/AppendIndexKeys", messages);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(result.status.error_message().find(
                "message 1 of the stream is not a valid dsa.indexer.v1.AppendIndexKeysRequest"),
            std::string::npos)
      << result.status.error_message();
  EXPECT_TRUE(result.responses.empty());
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 0);  // the first chunk was appended, then undone
  EXPECT_EQ(Load().used_blocks(), 0);
  // The same bytes without the bad message append both chunks.
  const testing::RawCallResult good = testing::RawCall(
      channel_, "/dsa.indexer.v1.IndexerService/AppendIndexKeys", {messages[0], messages[2]});
  ASSERT_TRUE(good.status.ok()) << good.status.error_message();
  ASSERT_EQ(good.responses.size(), 1u);
  v1::AppendIndexKeysResponse response;
  ASSERT_TRUE(response.ParseFromString(good.responses[0]));
  EXPECT_EQ(response.keys_appended(), 20);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 20);
}

TEST_F(GrpcServiceTest, AnUnparseableSelectStreamMessageFailsTheStreamNamingIt) {
  StartServer(8);
  std::mt19937 rng(32);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 82 * kD), 82);
  v1::SelectRequest good;
  good.set_request_id(1);
  AddGroup(&good, 1, 0, 79, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  v1::SelectRequest later = good;
  later.set_request_id(3);
  later.mutable_groups(0)->set_first_position(81);
  const testing::RawCallResult result = testing::RawCall(
      channel_, "/dsa.indexer.v1.IndexerService/SelectStream",
      {good.SerializeAsString(), testing::UnparseableMessage(), later.SerializeAsString()});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(result.status.error_message().find(
                "message 1 of the stream is not a valid dsa.indexer.v1.SelectRequest"),
            std::string::npos)
      << result.status.error_message();
  ASSERT_EQ(result.responses.size(), 1u);  // the request before it was answered; none after
  v1::SelectResponse response;
  ASSERT_TRUE(response.ParseFromString(result.responses[0]));
  EXPECT_EQ(response.request_id(), 1u);
  EXPECT_EQ(response.selections_size(), 1);
}

TEST_F(GrpcServiceTest, UnparseableUnaryRequestsGetInvalidArgumentNamingTheMethod) {
  StartServer(8);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  for (const char* method :
       {"CreateSequence", "Select", "Commit", "BeginTurn", "Release", "GetLoad", "OpenDataPlane"}) {
    const std::string name = absl::StrCat("/dsa.indexer.v1.IndexerService/", method);
    const testing::RawCallResult result =
        testing::RawCall(channel_, name, {testing::UnparseableMessage()});
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(result.status.error_message().find(
                  name + ": the request is not a valid message of the method's request type"),
              std::string::npos)
        << result.status.error_message();
  }
  // Nothing changed: the sequence is still there and a valid raw Release is served as usual.
  EXPECT_EQ(Load().sequences(), 1);
  v1::ReleaseRequest release;
  release.set_sequence_id(1);
  EXPECT_TRUE(testing::RawCall(channel_, "/dsa.indexer.v1.IndexerService/Release",
                               {release.SerializeAsString()})
                  .status.ok());
  EXPECT_EQ(Load().sequences(), 0);
}

// Adds new_index_keys fp32 [n, D] to the last group of `request`.
void SetNewKeys(v1::SelectRequest* request, const std::vector<float>& keys) {
  const int64_t shape[] = {static_cast<int64_t>(keys.size()) / kD, kD};
  EncodeFloatTensor(keys, shape,
                    request->mutable_groups(request->groups_size() - 1)->mutable_new_index_keys());
}

TEST_F(GrpcServiceTest, NewIndexKeysAreAppendedBeforeTheRowsSelect) {
  StartServer(256);
  std::mt19937 rng(21);
  ASSERT_TRUE(Create(CreateRequest(5, 2, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(5, EngineOptions(2, 0.4)).ok());
  for (int layer = 0; layer < 2; ++layer) AppendBoth(5, layer, RandomValues(rng, 300 * kD), 128);
  // Decode steps of one row, then a speculative step of three verifier rows, each carrying its
  // new keys in the select message; the twin appends then selects.
  int64_t position = 300;
  for (int rows : {1, 1, 3}) {
    for (int layer = 0; layer < 2; ++layer) {
      const Rows r = MakeRows(rng, rows, common::v1::DTYPE_FLOAT32);
      const std::vector<float> keys = RandomValues(rng, static_cast<size_t>(rows) * kD);
      v1::SelectRequest request;
      AddGroup(&request, 5, layer, position, r);
      SetNewKeys(&request, keys);
      v1::SelectResponse response;
      ASSERT_TRUE(Select(request, &response).ok()) << "rows " << rows << " layer " << layer;
      ASSERT_TRUE(twin_->AppendIndexKeys(5, layer, keys, rows).ok());
      auto expected = twin_->Select(5, layer, EngineRows(r, position));
      ASSERT_TRUE(expected.ok());
      EXPECT_EQ(Selections(response.selections(0)), expected->selections);
      EXPECT_EQ(*indexer_->NumSlots(5, layer), position + rows);
    }
    position += rows;
  }
  ASSERT_TRUE(Commit(5, 1).ok());
  ASSERT_TRUE(twin_->Commit(5, 1).ok());
  EXPECT_EQ(*indexer_->NumSlots(5, 0), *twin_->NumSlots(5, 0));
  EXPECT_EQ(*indexer_->NumSlots(5, 0), 302 + 2);
}

TEST_F(GrpcServiceTest, AFailedRequestWithNewIndexKeysAppendsNothing) {
  StartServer(12);  // 12 blocks: room for two sequences of 5 blocks and 2 spare
  std::mt19937 rng(22);
  for (uint64_t id : {1u, 2u}) {
    ASSERT_TRUE(Create(CreateRequest(id, 1, 0.4)).ok());
    ASSERT_TRUE(twin_->CreateSequence(id, EngineOptions(1, 0.4)).ok());
    AppendBoth(id, 0, RandomValues(rng, 320 * kD), 320);  // 5 blocks each
  }
  auto request_for = [&](uint64_t id, int64_t position, int rows, int num_keys) {
    v1::SelectRequest request;
    AddGroup(&request, id, 0, position, MakeRows(rng, rows, common::v1::DTYPE_FLOAT32));
    SetNewKeys(&request, RandomValues(rng, static_cast<size_t>(num_keys) * kD));
    return request;
  };
  v1::SelectResponse response;
  // Rows that do not end at the newest slot.
  grpc::Status status = Select(request_for(1, 320, 1, 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("newest slot"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  // Non-finite new keys.
  v1::SelectRequest bad = request_for(1, 320, 1, 1);
  std::vector<float> nan_key(kD, 0.5f);
  nan_key[3] = std::nanf("");
  SetNewKeys(&bad, nan_key);
  status = Select(bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("new_index_keys"), std::string::npos);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  // Two groups: the first's keys fit (a sixth block), the second's 129 keys need three more blocks
  // than the pool has left: nothing is appended, the first group's keys are removed again.
  v1::SelectRequest both = request_for(1, 320, 1, 1);
  v1::SelectRequest second = request_for(2, 320 + 128, 1, 129);
  *both.add_groups() = second.groups(0);
  status = Select(both, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("group 1 new_index_keys"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  EXPECT_EQ(*indexer_->NumSlots(2, 0), 320);
  EXPECT_EQ(Load().used_blocks(), 10);
  // A select that fails in its second group (position not after the last selected one): the
  // groups have distinct sequences, so all are checked first and nothing is applied, the first
  // group's new key included.
  ASSERT_TRUE(Select(request_for(2, 320, 1, 1), &response).ok());  // sequence 2 selected 320
  v1::SelectRequest replay = request_for(1, 320, 1, 1);
  v1::SelectRequest stale;
  AddGroup(&stale, 2, 0, 320, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));  // 320 again
  *replay.add_groups() = stale.groups(0);
  status = Select(replay, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("group 1"), std::string::npos) << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  EXPECT_EQ(*indexer_->NumSlots(2, 0), 321);
  // Sequence 1 has not selected 320: it still can.
  ASSERT_TRUE(Select(request_for(1, 320, 1, 1), &response).ok());
  // The server goes on serving both sequences.
  ASSERT_TRUE(Select(request_for(1, 321, 1, 1), &response).ok());
  ASSERT_TRUE(Select(request_for(2, 321, 1, 1), &response).ok());
}

TEST_F(GrpcServiceTest, AnAuditedGroupCarriesItsRowsMissRates) {
  // The fixture's server does not audit; this one audits every pruned select.
  auto indexer = Indexer::Create({256, kH, kD, /*audit_fraction=*/1.0, /*audit_seed=*/3});
  ASSERT_TRUE(indexer.ok());
  ASSERT_TRUE((*indexer)->CreateSequence(9, EngineOptions(1, 0.5)).ok());
  std::mt19937 rng(23);
  const std::vector<float> keys = RandomValues(rng, 1000 * kD);
  ASSERT_TRUE((*indexer)->AppendIndexKeys(9, 0, keys, 1000).ok());
  v1::SelectResponse response;
  for (int64_t position = 995; position < 1000; ++position) {
    v1::SelectRequest request;
    AddGroup(&request, 9, 0, position, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
    ASSERT_TRUE(RunSelect(**indexer, request, &response).ok());
  }
  // The first select is SPIN's warm-up (all blocks, not audited); the later ones are pruned.
  ASSERT_EQ(response.selections(0).audit_miss_rates_size(), 1);
  EXPECT_FALSE(response.selections(0).all_blocks());
  const double miss = response.selections(0).audit_miss_rates(0);
  EXPECT_GE(miss, 0.0);
  EXPECT_LE(miss, 1.0);
}

TEST(IndexerMetricsTest, AuditedRowsFeedTheMissRateHistogram) {
  prometheus::Registry registry;
  IndexerMetrics metrics(registry);
  EXPECT_EQ(MetricValue(registry, "dsa_indexer_audited_miss_ratio"), 0);
  SelectResult result;
  result.top_k = 4;
  result.selections.assign(8, -1);  // two verifier rows
  result.audit_miss_rates = {0.25, 0.5};
  metrics.RecordSelect(result);
  result.audit_miss_rates.clear();  // a select that was not audited observes nothing
  metrics.RecordSelect(result);
  EXPECT_EQ(MetricValue(registry, "dsa_indexer_audited_miss_ratio"), 2);
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name == "dsa_indexer_audited_miss_ratio") {
      EXPECT_DOUBLE_EQ(family.metric[0].histogram.sample_sum, 0.75);
    }
  }
}

TEST(IndexerMetricsTest, SpinSelectsFeedTheTargetSparsityHistogram) {
  prometheus::Registry registry;
  IndexerMetrics metrics(registry);
  SelectResult result;
  result.top_k = 4;
  result.selections.assign(4, -1);
  result.spin = true;
  result.target_block_sparsity = 0.35;
  metrics.RecordSelect(result);
  result.target_block_sparsity = 0.0;  // adaptive sparsity at rho 0 still counts
  metrics.RecordSelect(result);
  result.spin = false;  // all-keep: no rho
  metrics.RecordSelect(result);
  EXPECT_EQ(MetricValue(registry, "dsa_indexer_target_block_sparsity"), 2);
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name == "dsa_indexer_target_block_sparsity") {
      EXPECT_DOUBLE_EQ(family.metric[0].histogram.sample_sum, 0.35);
    }
  }
}

TEST(SpinSettingsTest, TheMissTargetCrossesTheWireOnlyWhenSet) {
  SpinConfig config;
  v1::SpinSettings settings = ToSpinSettings(config);
  EXPECT_FALSE(settings.has_miss_target());
  SpinConfig back;
  ASSERT_TRUE(ToSpinConfig(settings, &back).ok());
  EXPECT_FALSE(back.miss_target.has_value());
  config.miss_target = 0.05;
  settings = ToSpinSettings(config);
  ASSERT_TRUE(settings.has_miss_target());
  ASSERT_TRUE(ToSpinConfig(settings, &back).ok());
  ASSERT_TRUE(back.miss_target.has_value());
  EXPECT_DOUBLE_EQ(*back.miss_target, 0.05);
  config.miss_target = 0.0;  // an explicit 0 (rho fixed) overrides a deployment's target
  ASSERT_TRUE(ToSpinConfig(ToSpinSettings(config), &back).ok());
  EXPECT_EQ(back.miss_target, std::optional<double>(0.0));
}

TEST(IndexerMetricsTest, SelectsAreCountedByWhereTheyWereScored) {
  prometheus::Registry registry;
  IndexerMetrics metrics(registry);
  SelectResult result;
  result.top_k = 4;
  result.selections.assign(4, -1);
  result.on_device = true;
  metrics.RecordSelect(result);
  metrics.RecordSelect(result);
  result.on_device = false;
  metrics.RecordSelect(result);
  EXPECT_EQ(MetricValue(registry, "dsa_indexer_selects_total", "device"), 2);
  EXPECT_EQ(MetricValue(registry, "dsa_indexer_selects_total", "cpu"), 1);
}

// Samples of family `name` in the registry (a family without samples may be left out entirely).
size_t SampleCount(prometheus::Registry& registry, const std::string& name) {
  size_t samples = 0;
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name == name) samples += family.metric.size();
  }
  return samples;
}

TEST(IndexerMetricsTest, TheMissTargetIsExportedOnlyWhenSet) {
  prometheus::Registry registry;
  IndexerMetrics metrics(registry);
  // Before start-up sets it, and with --miss-target 0 (rho fixed): no series, so that the alert
  // falls back to its default threshold rather than judging against 0.
  EXPECT_EQ(SampleCount(registry, "dsa_indexer_miss_target_ratio"), 0u);
  metrics.SetMissTarget(0);
  EXPECT_EQ(SampleCount(registry, "dsa_indexer_miss_target_ratio"), 0u);
  metrics.SetMissTarget(0.2);
  EXPECT_EQ(SampleCount(registry, "dsa_indexer_miss_target_ratio"), 1u);
  EXPECT_DOUBLE_EQ(MetricValue(registry, "dsa_indexer_miss_target_ratio"), 0.2);
  metrics.SetMissTarget(0.05);  // set again: one series, the new value
  EXPECT_EQ(SampleCount(registry, "dsa_indexer_miss_target_ratio"), 1u);
  EXPECT_DOUBLE_EQ(MetricValue(registry, "dsa_indexer_miss_target_ratio"), 0.05);
  metrics.SetMissTarget(0);
  EXPECT_EQ(SampleCount(registry, "dsa_indexer_miss_target_ratio"), 0u);
}

}  // namespace
}  // namespace dsa
