// Tests of the gRPC adapter (indexer_service/grpc_service.h) against an in-process server on
// 127.0.0.1:0 (grpc_service_fixture.h): a full flow whose selections equal a twin engine called
// directly with the same values, prefix sharing, new index keys carried by a select, audits, and
// the service's metrics. Bad input and failed requests are in grpc_service_errors_test.cc.
#include "indexer_service/grpc_service.h"

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/indexer_service/grpc_service_fixture.h"

namespace dsa {
namespace {

using namespace ::dsa::grpc_service_testing;  // NOLINT(google-build-using-namespace)

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
