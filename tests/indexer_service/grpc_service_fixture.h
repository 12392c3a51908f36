// The fixture of the gRPC adapter's tests (grpc_service_test.cc, grpc_service_errors_test.cc): an
// in-process server on 127.0.0.1:0 over one Indexer, a twin engine called directly with the same
// values, and the row groups, chunks and requests both are given.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "prometheus/registry.h"
#include "proto/tensor_codec.h"
#include "server/parse_errors.h"
#include "tests/testing/loopback_server.h"

namespace dsa::grpc_service_testing {

namespace v1 = ::dsa::indexer::v1;
using ::dsa::common::v1::DType;
using ::dsa::common::v1::Tensor;

inline constexpr int kH = 4, kD = 16, kK = 64;

inline std::vector<float> RandomValues(std::mt19937& rng, size_t count) {
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
inline Rows MakeRows(std::mt19937& rng, int num_rows, DType dtype) {
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

inline std::vector<IndexerRow> EngineRows(const Rows& rows, int64_t first_position) {
  const size_t num_rows = rows.weights.size() / kH;
  std::vector<IndexerRow> out(num_rows);
  for (size_t r = 0; r < num_rows; ++r) {
    out[r].query = std::span<const float>(rows.queries.data() + r * kH * kD, kH * kD);
    out[r].head_weights = std::span<const float>(rows.weights.data() + r * kH, kH);
    out[r].position = first_position + static_cast<int64_t>(r);
  }
  return out;
}

inline void AddGroup(v1::SelectRequest* request, uint64_t id, int layer, int64_t first_position,
                     const Rows& rows) {
  v1::RowGroup* group = request->add_groups();
  group->set_sequence_id(id);
  group->set_layer(layer);
  group->set_first_position(first_position);
  *group->mutable_queries() = rows.query_tensor;
  *group->mutable_head_weights() = rows.weight_tensor;
}

inline std::vector<int32_t> Selections(const v1::GroupSelection& selection) {
  auto values = DecodeInt32Tensor(selection.selections(), std::vector<int64_t>{-1, kK}, "sel");
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<int32_t>{};
}

inline v1::CreateSequenceRequest CreateRequest(uint64_t id, int num_layers, double rho) {
  v1::CreateSequenceRequest request;
  request.set_sequence_id(id);
  request.set_num_layers(num_layers);
  request.set_top_k(kK);
  request.mutable_spin()->set_target_block_sparsity(rho);
  request.mutable_spin()->set_seed(7);
  return request;
}

inline SequenceOptions EngineOptions(int num_layers, double rho) {
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
inline double MetricValue(prometheus::Registry& registry, const std::string& name,
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
    channel_ = ::dsa::testing::ConnectedLoopbackChannel(absl::StrCat("127.0.0.1:", port));
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

// Adds new_index_keys fp32 [n, D] to the last group of `request`.
inline void SetNewKeys(v1::SelectRequest* request, const std::vector<float>& keys) {
  const int64_t shape[] = {static_cast<int64_t>(keys.size()) / kD, kD};
  EncodeFloatTensor(keys, shape,
                    request->mutable_groups(request->groups_size() - 1)->mutable_new_index_keys());
}

}  // namespace dsa::grpc_service_testing
