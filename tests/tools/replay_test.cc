// Tests of `dsa replay`: the report aggregation on hand-computed records, the trace caps, the
// real-text contexts (ContextTokenSource) and the fit to a model's max context, and the client
// against an in-process fake CoordinatorService (counts, the event figures, the --max-in-flight
// limit, arrival times, a refused request; a real model's token ids, finish reasons, sample
// outputs and refusals), including the `dsa` binary's exit status.
#include "tools/dsa/replay.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::coordinator::v1;
using Clock = std::chrono::steady_clock;

TEST(NearestRankPercentile, HandComputed) {
  const std::vector<double> values = {5, 1, 4, 2, 3};
  EXPECT_EQ(NearestRankPercentile(values, 50), 3);   // rank ceil(2.5) = 3
  EXPECT_EQ(NearestRankPercentile(values, 99), 5);   // rank ceil(4.95) = 5
  EXPECT_EQ(NearestRankPercentile(values, 20), 1);   // rank ceil(1.0) = 1
  EXPECT_EQ(NearestRankPercentile(values, 100), 5);  // rank 5
  EXPECT_EQ(NearestRankPercentile({7}, 1), 7);
  EXPECT_EQ(NearestRankPercentile({}, 50), 0);
}

RequestRecord Completed(int64_t index) {
  RequestRecord record;
  record.index = index;
  record.admitted = true;
  return record;
}

TEST(AggregateReplay, HandComputedFigures) {
  std::vector<RequestRecord> records;
  RequestRecord r0 = Completed(0);
  r0.context_tokens = 1000;
  r0.prefix_slots_reused = 512;
  r0.client_wait_seconds = 0.5;
  r0.ttft_seconds = 0.1;
  r0.inter_token_seconds = {0.01, 0.03};
  r0.generated_tokens = 5;
  r0.drafted_tokens = 4;
  r0.accepted_tokens = 2;
  r0.blocks_scored = 30;
  r0.blocks_visible = 100;
  r0.audited_rows = 2;
  r0.audit_miss_rate_sum = 0.1;
  r0.selection_wait_seconds = {{0.001, 0.002}, {0.003, 0.004}};
  records.push_back(r0);
  RequestRecord r1 = Completed(1);
  r1.context_tokens = 3000;
  r1.ttft_seconds = 0.3;
  r1.inter_token_seconds = {0.02};
  r1.generated_tokens = 3;
  r1.drafted_tokens = 2;
  r1.accepted_tokens = 1;
  r1.blocks_scored = 50;
  r1.blocks_visible = 100;
  r1.selection_wait_seconds = {{0.005, 0.006, 0.007}};
  records.push_back(r1);
  for (int64_t index : {2, 3}) {
    RequestRecord failed;
    failed.index = index;
    failed.context_tokens = 9000;  // never admitted: not in the context slots
    failed.status_code = static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED);
    failed.error = "queue full";
    records.push_back(failed);
  }
  RequestRecord cancelled;
  cancelled.index = 4;
  cancelled.status_code = static_cast<int>(grpc::StatusCode::CANCELLED);
  records.push_back(cancelled);
  const std::vector<CacheSample> samples = {
      {0.0, 10, 100, 0, 0}, {0.5, 30, 100, 1, 2}, {1.0, 20, 100, 0, 1}};
  ReplayOptions options;
  options.caps = {20, 4096, 8};
  options.time_scale = 0;
  options.max_in_flight = 4;
  options.draft_length = 2;

  const ReplayReport report = AggregateReplay(records, samples, 2.0, options);
  EXPECT_EQ(report.requests, 5);
  EXPECT_EQ(report.completed, 2);
  EXPECT_EQ(report.failed, 3);
  EXPECT_EQ(report.failures_by_code,
            (std::map<std::string, int64_t>{{"RESOURCE_EXHAUSTED", 2}, {"CANCELLED", 1}}));
  EXPECT_EQ(report.first_error, "request 2: RESOURCE_EXHAUSTED: queue full");
  EXPECT_DOUBLE_EQ(report.ttft_p50, 0.1);  // {0.1, 0.3}: rank ceil(1.0) = 1
  EXPECT_DOUBLE_EQ(report.ttft_p99, 0.3);  // rank ceil(1.98) = 2
  EXPECT_DOUBLE_EQ(report.itl_p50, 0.02);  // {0.01, 0.02, 0.03}: rank 2
  EXPECT_DOUBLE_EQ(report.itl_p99, 0.03);  // rank 3
  EXPECT_DOUBLE_EQ(report.itl_max, 0.03);
  EXPECT_DOUBLE_EQ(report.client_wait_mean, 0.1);  // 0.5 / 5 records
  EXPECT_DOUBLE_EQ(report.client_wait_max, 0.5);
  EXPECT_EQ(report.generated_tokens, 8);
  EXPECT_DOUBLE_EQ(report.decode_tokens_per_second, 4.0);  // 8 tokens / 2 s
  EXPECT_EQ(report.blocks_scored, 80);
  EXPECT_EQ(report.blocks_visible, 200);
  EXPECT_DOUBLE_EQ(report.realized_block_sparsity, 0.6);  // 1 - 80 / 200
  EXPECT_EQ(report.audited_rows, 2);
  EXPECT_DOUBLE_EQ(report.audited_miss_rate, 0.05);  // 0.1 / 2
  EXPECT_EQ(report.prefix_slots_reused, 512);
  EXPECT_EQ(report.context_slots, 4000);
  EXPECT_DOUBLE_EQ(report.prefix_reuse_fraction, 0.128);  // 512 / 4000
  EXPECT_EQ(report.drafted_tokens, 6);
  EXPECT_EQ(report.accepted_tokens, 3);
  EXPECT_DOUBLE_EQ(report.spec_acceptance, 0.5);
  EXPECT_DOUBLE_EQ(report.cache_used_min, 10);
  EXPECT_DOUBLE_EQ(report.cache_used_mean, 20);
  EXPECT_DOUBLE_EQ(report.cache_used_max, 30);
  EXPECT_EQ(report.cache_capacity, 100);
  ASSERT_EQ(report.selection_wait.size(), 3u);
  EXPECT_EQ(report.selection_wait[0].steps, 3);
  EXPECT_NEAR(report.selection_wait[0].mean_seconds, 0.003, 1e-15);  // {1, 3, 5} ms
  EXPECT_DOUBLE_EQ(report.selection_wait[0].p99_seconds, 0.005);
  EXPECT_NEAR(report.selection_wait[1].mean_seconds, 0.004, 1e-15);  // {2, 4, 6} ms
  EXPECT_DOUBLE_EQ(report.selection_wait[1].p99_seconds, 0.006);
  EXPECT_EQ(report.selection_wait[2].steps, 1);
  EXPECT_DOUBLE_EQ(report.selection_wait[2].mean_seconds, 0.007);

  const nlohmann::json json = ReplayReportToJson(report);
  EXPECT_EQ(json["requests"]["failed"], 3);
  EXPECT_EQ(json["requests"]["failures_by_code"]["RESOURCE_EXHAUSTED"], 2);
  EXPECT_EQ(json["settings"]["max_context"], 4096);
  EXPECT_EQ(json["cache_use"]["samples"].size(), 3u);
  EXPECT_EQ(json["cache_use"]["samples"][1]["cache_blocks_used"], 30);
  EXPECT_DOUBLE_EQ(json["indexer"]["audited_miss_rate"].get<double>(), 0.05);
  EXPECT_EQ(json["selection_wait_per_layer"].size(), 3u);
  const std::string markdown = ReplayReportToMarkdown(report);
  EXPECT_NE(markdown.find("| requests completed / failed | 2 / 3 (CANCELLED: 1, "
                          "RESOURCE_EXHAUSTED: 2) of 5 |"),
            std::string::npos)
      << markdown;
  EXPECT_NE(markdown.find("0.6000 (80 of 200 blocks scored)"), std::string::npos) << markdown;
  EXPECT_NE(markdown.find("0.0500 over 2 rows"), std::string::npos) << markdown;
}

TEST(AggregateReplay, NothingAuditedOrVisible) {
  RequestRecord record = Completed(0);
  record.generated_tokens = 1;
  const ReplayReport report = AggregateReplay({record}, {}, 1.0, ReplayOptions());
  EXPECT_EQ(report.audited_miss_rate, -1);
  EXPECT_EQ(report.realized_block_sparsity, 0);
  EXPECT_EQ(report.spec_acceptance, 0);
  EXPECT_TRUE(ReplayReportToJson(report)["indexer"]["audited_miss_rate"].is_null());
  EXPECT_NE(ReplayReportToMarkdown(report).find("| audited miss rate | not audited |"),
            std::string::npos);
}

TEST(ReusablePrefixSlots, LeadingRunOfWholeBlocksSeenBefore) {
  // Request 0 shares nothing (nothing before it); its 4 ids are whole blocks. Request 1 repeats
  // ids 1, 2 then diverges: 2 blocks = 1024. Request 2 starts with an unseen id: 0, though id 2
  // follows. Request 3 (1,000 tokens) has ids {1, 2}: a run of 2, capped at its context rounded
  // down to 64: 960. Request 4 repeats id 9 (a whole block of request 2): 512. Request 5 starts
  // with id 6 (a whole block of request 1), then the unseen 7: 512.
  const std::vector<TraceRequest> requests = {
      {0, 2048, 1, {1, 2, 3, 4}}, {0, 2048, 1, {1, 2, 5, 6}}, {0, 1536, 1, {9, 2, 3}},
      {0, 1000, 1, {1, 2}},       {0, 600, 1, {9}},           {0, 700, 1, {6, 7}},
  };
  EXPECT_EQ(ReusablePrefixSlots(requests), 1024 + 0 + 960 + 512 + 512);
  // A partial last block is never a donor: request 0's second block (1,000 tokens) is not whole.
  EXPECT_EQ(ReusablePrefixSlots({{0, 1000, 1, {1, 2}}, {0, 2048, 1, {1, 2, 3, 4}}}), 512);
  EXPECT_EQ(ReusablePrefixSlots({}), 0);
}

// A corpus whose ids are their positions, so a slice names its offset.
std::vector<int32_t> PositionCorpus(int n) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = i;
  return tokens;
}

TEST(ContextTokenSource, EqualHashIdsGetEqualBlocksAndOthersDiffer) {
  auto source = ContextTokenSource::Create(PositionCorpus(5000));
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(source->num_offsets(), 5000 - 511);
  // Requests 0 and 1 share hash ids 7 and 8, then diverge; request 2 has no ids at all.
  const TraceRequest a = {0, 1600, 1, {7, 8, 9, 10}};
  const TraceRequest b = {0, 1300, 1, {7, 8, 11}};
  const TraceRequest c = {0, 700, 1, {}};
  const std::vector<int32_t> ca = source->Context(a, 0), cb = source->Context(b, 1);
  ASSERT_EQ(ca.size(), 1600u);
  ASSERT_EQ(cb.size(), 1300u);
  // The shared blocks: identical, each a contiguous slice at BlockOffset(id).
  EXPECT_TRUE(std::equal(ca.begin(), ca.begin() + 1024, cb.begin()));
  for (int j = 0; j < 512; ++j) {
    EXPECT_EQ(ca[j], source->BlockOffset(7) + j);
    EXPECT_EQ(ca[512 + j], source->BlockOffset(8) + j);
  }
  // The third block: different ids, different text; b's is cut at its context (276 tokens).
  EXPECT_EQ(ca[1024], source->BlockOffset(9));
  EXPECT_EQ(cb[1024], source->BlockOffset(11));
  EXPECT_NE(ca[1024], cb[1024]);
  EXPECT_EQ(cb.back(), source->BlockOffset(11) + 275);
  // The fourth block of a is partial (64 tokens).
  EXPECT_EQ(ca.back(), source->BlockOffset(10) + 63);
  // Distinct ids below the number of offsets never share a slice.
  std::set<int64_t> offsets;
  for (uint64_t id = 0; id < 4489; ++id) offsets.insert(source->BlockOffset(id));
  EXPECT_EQ(offsets.size(), 4489u);
  // Blocks without an id: deterministic, by request and block.
  const std::vector<int32_t> cc = source->Context(c, 2);
  ASSERT_EQ(cc.size(), 700u);
  EXPECT_EQ(cc, source->Context(c, 2));
  EXPECT_EQ(cc[0], source->UnsharedBlockOffset(2, 0));
  EXPECT_EQ(cc[512], source->UnsharedBlockOffset(2, 1));
  EXPECT_NE(source->Context(c, 3), cc);
  EXPECT_EQ(source->max_token(), 4999);
}

TEST(ContextTokenSource, RefusesAShortOrNegativeCorpus) {
  EXPECT_EQ(ContextTokenSource::Create(PositionCorpus(511)).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> negative = PositionCorpus(600);
  negative[10] = -1;
  EXPECT_EQ(ContextTokenSource::Create(negative).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto exact = ContextTokenSource::Create(PositionCorpus(512));  // one slice, at 0
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->BlockOffset(12345), 0);
  EXPECT_EQ(exact->Context({0, 1024, 1, {1, 2}}, 0), [] {
    std::vector<int32_t> twice = PositionCorpus(512);
    twice.insert(twice.end(), twice.begin(), twice.end());
    return twice;
  }());
}

TEST(FitToModelContext, CutsContextsThatDoNotFit) {
  std::vector<TraceRequest> requests = {
      {0, 8000, 300, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}},
      {0, 1000, 32, {1, 2}},
      {0, 10, 9000, {1}},
  };
  EXPECT_EQ(FitToModelContext(requests, 8192), 2);
  EXPECT_EQ(requests[0].context_tokens, 7892);
  EXPECT_EQ(requests[0].prefix_block_ids.size(), 16u);  // ceil(7892 / 512) = 16
  EXPECT_EQ(requests[0].output_tokens, 300);
  EXPECT_EQ(requests[1].context_tokens, 1000);  // fits: unchanged
  EXPECT_EQ(requests[2].output_tokens, 8191);
  EXPECT_EQ(requests[2].context_tokens, 1);
  std::vector<TraceRequest> unlimited = {{0, 100000, 5, {}}};
  EXPECT_EQ(FitToModelContext(unlimited, 0), 0);
  EXPECT_EQ(unlimited[0].context_tokens, 100000);
}

TEST(ApplyCaps, LimitContextPrefixIdsAndOutput) {
  std::vector<TraceRequest> requests(3);
  requests[0] = {0, 5000, 100, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};  // ceil(5000 / 512) = 10 ids
  requests[1] = {10, 600, 4, {1, 11}};
  requests[2] = {20, 7000, 9, {}};
  const std::vector<TraceRequest> capped = ApplyCaps(requests, {2, 1100, 8});
  ASSERT_EQ(capped.size(), 2u);
  EXPECT_EQ(capped[0].context_tokens, 1100);
  EXPECT_EQ(capped[0].prefix_block_ids, (std::vector<uint64_t>{1, 2, 3}));  // ceil(1100/512)
  EXPECT_EQ(capped[0].output_tokens, 8);
  EXPECT_EQ(capped[0].arrival_ms, 0);
  EXPECT_EQ(capped[1].context_tokens, 600);  // under the cap: unchanged
  EXPECT_EQ(capped[1].prefix_block_ids, (std::vector<uint64_t>{1, 11}));
  EXPECT_EQ(capped[1].output_tokens, 4);
  EXPECT_EQ(capped[1].arrival_ms, 10);

  const std::vector<TraceRequest> exact = ApplyCaps(requests, {0, 1024, 0});
  ASSERT_EQ(exact.size(), 3u);
  EXPECT_EQ(exact[0].prefix_block_ids, (std::vector<uint64_t>{1, 2}));  // 1024 = 2 whole blocks
  EXPECT_EQ(exact[2].output_tokens, 9);

  const std::vector<TraceRequest> uncapped = ApplyCaps(requests, {});
  ASSERT_EQ(uncapped.size(), 3u);
  EXPECT_EQ(uncapped[0].context_tokens, 5000);
  EXPECT_EQ(uncapped[0].prefix_block_ids.size(), 10u);
  EXPECT_EQ(uncapped[0].output_tokens, 100);
}

// A fake coordinator: streams Admitted, one Tokens per step of min(2, remaining) tokens, then
// Finished; refuses the request ids in `refuse` with RESOURCE_EXHAUSTED; records what it got and
// how many streams were open at once.
class FakeCoordinator final : public v1::CoordinatorService::Service {
 public:
  std::set<std::string> refuse;
  std::chrono::milliseconds step_time{5};
  /// GetLoad's model when named; a real model when its vocab_size > 0: Tokens carry ids (1000 +
  /// the position), requests in `end_with_eos` end after their first token with
  /// FINISH_REASON_EOS (id 2), those in `bad_ids` stream the id vocab_size.
  v1::Model model;
  std::set<std::string> end_with_eos, bad_ids;

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateEvent>* writer) override {
    const int open = ++open_;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      max_open_ = std::max(max_open_, open);
      received_.push_back(*request);
      arrivals_[request->request_id()] = Clock::now();
    }
    struct Close {
      std::atomic<int>& open;
      ~Close() { --open; }
    } close{open_};
    if (refuse.count(request->request_id()) > 0) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, "the fake refuses " + request->request_id()};
    }
    v1::GenerateEvent admitted;
    admitted.mutable_admitted()->set_prefix_slots_reused(512 * request->prefix_block_ids_size());
    writer->Write(admitted);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++admitted_;
    }
    admitted_cv_.notify_all();
    const bool real = model.vocab_size() > 0;
    int64_t position = request->has_context_tokens() ? request->context_tokens().tokens_size()
                                                     : request->context_length();
    const bool eos = end_with_eos.count(request->request_id()) > 0;
    for (int64_t left = eos ? 1 : request->max_new_tokens(); left > 0;) {
      std::this_thread::sleep_for(step_time);
      if (context->IsCancelled()) return {grpc::StatusCode::CANCELLED, "cancelled"};
      const int count = static_cast<int>(std::min<int64_t>(2, left));
      v1::GenerateEvent event;
      v1::Tokens* tokens = event.mutable_tokens();
      tokens->set_first_position(position);
      tokens->set_count(count);
      tokens->set_drafted(request->draft_length());
      tokens->set_accepted(count - 1);
      tokens->set_blocks_scored(3);
      tokens->set_blocks_visible(4);
      tokens->set_audited_rows(1);
      tokens->set_audit_miss_rate_sum(0.25);
      tokens->add_selection_wait_seconds(0.001);
      tokens->add_selection_wait_seconds(0.002);
      for (int i = 0; real && i < count; ++i) {
        tokens->add_token_ids(eos                                        ? 2
                              : bad_ids.count(request->request_id()) > 0 ? model.vocab_size()
                                                                         : 1000 + position + i);
      }
      writer->Write(event);
      position += count;
      left -= count;
    }
    v1::GenerateEvent finished;
    finished.mutable_finished()->set_generated_tokens(eos ? 1 : request->max_new_tokens());
    finished.mutable_finished()->set_finish_reason(eos ? v1::FINISH_REASON_EOS
                                                       : v1::FINISH_REASON_LENGTH);
    if (eos) finished.mutable_finished()->set_stop_token_id(2);
    writer->Write(finished);
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortResponse*) override {
    return {grpc::StatusCode::UNIMPLEMENTED, "fake"};
  }

  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::GetLoadResponse* response) override {
    ++load_calls_;
    if (!model.name().empty()) *response->mutable_model() = model;
    response->set_running(open_);
    response->set_cache_blocks_used(10 * open_);
    response->set_cache_blocks_capacity(1000);
    return grpc::Status::OK;
  }

  int max_open() {
    std::lock_guard<std::mutex> lock(mutex_);
    return max_open_;
  }
  std::vector<v1::GenerateRequest> received() {
    std::lock_guard<std::mutex> lock(mutex_);
    return received_;
  }
  Clock::time_point arrival(const std::string& id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return arrivals_.at(id);
  }
  int load_calls() const { return load_calls_; }
  /// Waits until `n` streams have been sent their Admitted event, or `timeout`; whether they were.
  bool AwaitAdmitted(int n, std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return admitted_cv_.wait_for(lock, timeout, [&] { return admitted_ >= n; });
  }

 private:
  std::atomic<int> open_{0};
  std::atomic<int> load_calls_{0};
  std::mutex mutex_;
  int max_open_ = 0;
  int admitted_ = 0;
  std::condition_variable admitted_cv_;  // notified as admitted_ grows
  std::vector<v1::GenerateRequest> received_;
  std::map<std::string, Clock::time_point> arrivals_;
};

class FakeCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override { server_->Shutdown(); }

  // `n` requests of 3000 context tokens (6 prefix ids, capped to 4 by max_context 2000), 9 output
  // tokens (capped to 4), arriving every `gap_ms`.
  static std::vector<TraceRequest> Trace(int n, int64_t gap_ms) {
    std::vector<TraceRequest> requests;
    requests.reserve(n);
    for (int i = 0; i < n; ++i) {
      requests.push_back({i * gap_ms, 3000, 9, {0, 1, 2, 3, 4, 5}});
    }
    return requests;
  }

  FakeCoordinator fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(FakeCoordinatorTest, ReportsEveryRequestAndRespectsMaxInFlight) {
  ReplayOptions options;
  options.coordinator = address_;
  options.caps = {0, 2000, 4};
  options.time_scale = 0;
  options.max_in_flight = 3;
  options.draft_length = 2;
  options.sample_ms = 5;
  const std::vector<TraceRequest> requests = ApplyCaps(Trace(20, 0), options.caps);
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();

  EXPECT_EQ(report->requests, 20);
  EXPECT_EQ(report->completed, 20);
  EXPECT_EQ(report->failed, 0);
  EXPECT_TRUE(report->failures_by_code.empty());
  // 20 requests x 2 steps of 2 tokens.
  EXPECT_EQ(report->generated_tokens, 80);
  EXPECT_EQ(report->drafted_tokens, 80);   // 2 per step
  EXPECT_EQ(report->accepted_tokens, 40);  // 1 per step
  EXPECT_DOUBLE_EQ(report->spec_acceptance, 0.5);
  EXPECT_DOUBLE_EQ(report->realized_block_sparsity, 0.25);  // 1 - 3 / 4 every step
  EXPECT_EQ(report->audited_rows, 40);
  EXPECT_DOUBLE_EQ(report->audited_miss_rate, 0.25);
  EXPECT_EQ(report->prefix_slots_reused, 20 * 4 * 512);
  EXPECT_EQ(report->context_slots, 20 * 2000);
  ASSERT_EQ(report->selection_wait.size(), 2u);
  EXPECT_EQ(report->selection_wait[0].steps, 40);
  EXPECT_DOUBLE_EQ(report->selection_wait[1].mean_seconds, 0.002);
  EXPECT_GT(report->ttft_p50, 0.004);  // at least one 5 ms step
  EXPECT_GE(report->ttft_p99, report->ttft_p50);
  EXPECT_GT(report->itl_p50, 0.001);  // 5 ms steps of 2 tokens: about 2.5 ms a token
  EXPECT_GT(report->decode_tokens_per_second, 0);
  EXPECT_GT(report->client_wait_max, 0.004);  // later requests waited for a slot
  EXPECT_FALSE(report->cache_samples.empty());
  EXPECT_EQ(report->cache_capacity, 1000);
  EXPECT_LE(report->cache_used_max, 30);  // never more than 3 streams of 10 blocks

  // The concurrency limit held, and was reached (20 requests all due at once).
  EXPECT_EQ(fake_.max_open(), 3);
  // What the coordinator got: the capped request, the draft length, unique ids.
  const std::vector<v1::GenerateRequest> received = fake_.received();
  ASSERT_EQ(received.size(), 20u);
  std::set<std::string> ids;
  for (const v1::GenerateRequest& request : received) {
    ids.insert(request.request_id());
    EXPECT_EQ(request.context_length(), 2000);
    EXPECT_EQ(request.prefix_block_ids_size(), 4);
    EXPECT_EQ(request.max_new_tokens(), 4);
    EXPECT_EQ(request.draft_length(), 2);
  }
  EXPECT_EQ(ids.size(), 20u);
}

TEST_F(FakeCoordinatorTest, KeepsScaledArrivalTimes) {
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0.5;  // arrivals 0, 200, 400 ms -> 0, 100, 200 ms
  options.max_in_flight = 8;
  const std::vector<TraceRequest> requests = ApplyCaps(Trace(3, 200), {0, 0, 2});
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 3);
  const double gap =
      std::chrono::duration<double>(fake_.arrival("replay-2") - fake_.arrival("replay-0")).count();
  EXPECT_GE(gap, 0.19);
  EXPECT_LT(gap, 0.39);  // not the unscaled 400 ms
  EXPECT_GE(report->wall_seconds, 0.2);
}

TEST_F(FakeCoordinatorTest, RefusedRequestIsCountedByCode) {
  fake_.refuse = {"replay-3"};
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  options.max_in_flight = 2;
  const std::vector<TraceRequest> requests = ApplyCaps(Trace(6, 0), {0, 1000, 2});
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 5);
  EXPECT_EQ(report->failed, 1);
  EXPECT_EQ(report->failures_by_code, (std::map<std::string, int64_t>{{"RESOURCE_EXHAUSTED", 1}}));
  EXPECT_NE(report->first_error.find("request 3: RESOURCE_EXHAUSTED: the fake refuses replay-3"),
            std::string::npos)
      << report->first_error;
  EXPECT_EQ(report->context_slots, 5 * 1000);  // the refused one was never admitted
}

TEST_F(FakeCoordinatorTest, StopCancelsStreamsInFlight) {
  fake_.step_time = std::chrono::milliseconds(50);
  std::atomic<bool> stop{false};
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  options.max_in_flight = 2;
  options.stop = &stop;
  std::vector<TraceRequest> requests = Trace(6, 0);
  for (TraceRequest& request : requests) request.output_tokens = 1000;  // 25 s of 50 ms steps
  std::thread stopper([this, &stop] {
    // Both streams in flight (max_in_flight 2), each with 25 s of steps to go.
    EXPECT_TRUE(fake_.AwaitAdmitted(2, std::chrono::seconds(20)));
    stop = true;
  });
  const auto started = Clock::now();
  auto report = RunReplay(requests, options);
  stopper.join();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - started).count(), 5.0);
  EXPECT_EQ(report->completed, 0);
  EXPECT_EQ(report->failed, 6);
  EXPECT_EQ(report->failures_by_code.count("CANCELLED"), 1u);
}

TEST_F(FakeCoordinatorTest, AStopBeforeTheLastArrivalCountsTheUnsentRequestsAsFailed) {
  // Before, the requests a stop kept from being sent counted as completed and the replay passed.
  std::atomic<bool> stop{false};
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 1;
  options.stop = &stop;
  const std::vector<TraceRequest> requests = Trace(4, 600000);  // one every 10 minutes
  // The stop comes once the replay itself says the first request is done (its progress lines on a
  // pipe), so it falls between the first arrival and the second whatever the timing.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  FILE* progress = fdopen(fds[1], "w");
  ASSERT_NE(progress, nullptr);
  options.progress = progress;
  options.progress_period_ms = 1;
  bool saw_first_done = false;
  std::thread stopper([&stop, &saw_first_done, read_fd = fds[0]] {
    std::string lines;
    char buffer[4096];
    // Reads to the end, so that the replay never blocks on a full pipe.
    for (ssize_t n; (n = read(read_fd, buffer, sizeof(buffer))) > 0;) {
      lines.append(buffer, static_cast<size_t>(n));
      if (!saw_first_done && lines.find(" 1/4 done") != std::string::npos) {
        saw_first_done = true;
        stop = true;
      }
    }
    close(read_fd);
  });
  auto report = RunReplay(requests, options);
  std::fclose(progress);  // the stopper's end of file
  stopper.join();
  EXPECT_TRUE(saw_first_done);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->stopped);
  EXPECT_EQ(report->completed, 1);  // the first arrives at once and finishes in 9 steps
  EXPECT_EQ(report->failed, 3);
  EXPECT_EQ(report->failures_by_code, (std::map<std::string, int64_t>{{"CANCELLED", 3}}));
  EXPECT_NE(report->first_error.find("replay stopped before sending"), std::string::npos)
      << report->first_error;
  EXPECT_NE(ReplayReportToMarkdown(*report).find("stopped by a signal"), std::string::npos);
  EXPECT_EQ(ReplayReportToJson(*report)["requests"]["stopped"], true);
}

TEST_F(FakeCoordinatorTest, RealModelGetsRealTextTokensAndReportsFinishReasonsAndSamples) {
  fake_.model.set_name("smollm2-135m");
  fake_.model.set_vocab_size(49152);
  fake_.model.set_eos_token_id(2);
  fake_.model.set_max_context(3000);
  fake_.end_with_eos = {"replay-1"};
  auto source = ContextTokenSource::Create(PositionCorpus(4000));
  ASSERT_TRUE(source.ok());
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  options.max_in_flight = 2;
  options.tokens = &*source;
  options.token_file = "corpus.npy";
  options.sample_outputs = 2;
  // 4 requests of 3000 context tokens (6 ids), 9 output tokens: cut to 2991 by the model's 3000.
  const std::vector<TraceRequest> requests = Trace(4, 0);
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 4) << report->first_error;  // the EOS one ended early, complete
  EXPECT_EQ(report->contexts_cut_to_model, 4);
  EXPECT_EQ(report->model_name, "smollm2-135m");
  EXPECT_EQ(report->finish_reasons, (std::map<std::string, int64_t>{{"EOS", 1}, {"LENGTH", 3}}));
  EXPECT_EQ(report->generated_tokens, 3 * 9 + 1);
  ASSERT_EQ(report->samples.size(), 2u);
  EXPECT_EQ(report->samples[0].index, 0);
  EXPECT_EQ(report->samples[0].status, "OK");
  EXPECT_EQ(report->samples[0].finish_reason, "LENGTH");
  EXPECT_EQ(report->samples[0].context_tokens, 2991);
  ASSERT_EQ(report->samples[0].token_ids.size(), 9u);
  EXPECT_EQ(report->samples[0].token_ids[0], 1000 + 2991);
  EXPECT_EQ(report->samples[1].token_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(report->samples[1].finish_reason, "EOS");
  ASSERT_EQ(report->samples[0].context_tail_ids.size(), size_t{kSampleContextTailTokens});
  // Block 5 (ids 5: the trace's sixth) holds slots [2560, 2991): its last id ends the context.
  EXPECT_EQ(report->samples[0].context_tail_ids.back(), source->BlockOffset(5) + 2990 - 2560);

  const std::vector<v1::GenerateRequest> received = fake_.received();
  ASSERT_EQ(received.size(), 4u);
  for (const v1::GenerateRequest& request : received) {
    ASSERT_TRUE(request.has_context_tokens());
    EXPECT_EQ(request.context_tokens().tokens_size(), 2991);
    EXPECT_EQ(request.prefix_block_ids_size(), 0);  // refused with context_tokens
    EXPECT_FALSE(request.has_sampling());           // greedy
    EXPECT_FALSE(request.ignore_eos());
    // Every request shares the trace's ids 0..5, so every context is the same text.
    EXPECT_EQ(request.context_tokens().tokens(512), source->BlockOffset(1));
  }
  const nlohmann::json json = ReplayReportToJson(*report);
  EXPECT_EQ(json["finish_reasons"]["EOS"], 1);
  EXPECT_EQ(json["samples"].size(), 2u);
  EXPECT_EQ(json["samples"][1]["token_ids"], nlohmann::json::array({2}));
  EXPECT_EQ(json["real_tokens"]["token_file"], "corpus.npy");
  EXPECT_EQ(json["model"]["vocab_size"], 49152);
  const std::string markdown = ReplayReportToMarkdown(*report);
  EXPECT_NE(markdown.find("| finish reasons (completed requests) | EOS: 1, LENGTH: 3 |"),
            std::string::npos)
      << markdown;
  EXPECT_NE(markdown.find("| sampling | greedy; ends at EOS |"), std::string::npos) << markdown;
  EXPECT_NE(markdown.find("| 1 | 2991 | OK | EOS | 2 |"), std::string::npos) << markdown;
}

TEST_F(FakeCoordinatorTest, RealModelSamplingSeedsPerRequest) {
  fake_.model.set_name("smollm2-135m");
  fake_.model.set_vocab_size(49152);
  auto source = ContextTokenSource::Create(PositionCorpus(2000));
  ASSERT_TRUE(source.ok());
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  options.tokens = &*source;
  options.sampling = {0.7F, 0.9F, 100, true};
  auto report = RunReplay(ApplyCaps(Trace(3, 0), {0, 1000, 2}), options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 3);
  std::set<uint64_t> seeds;
  for (const v1::GenerateRequest& request : fake_.received()) {
    ASSERT_TRUE(request.has_sampling());
    EXPECT_FLOAT_EQ(request.sampling().temperature(), 0.7F);
    EXPECT_FLOAT_EQ(request.sampling().top_p(), 0.9F);
    EXPECT_TRUE(request.ignore_eos());
    seeds.insert(request.sampling().seed());
  }
  EXPECT_EQ(seeds, (std::set<uint64_t>{100, 101, 102}));
  EXPECT_NE(ReplayReportToMarkdown(*report).find(
                "| sampling | temperature 0.7, top-p 0.9, seed 100 + request index; ignore_eos |"),
            std::string::npos);
}

TEST_F(FakeCoordinatorTest, RealModelTokenIdsOutsideTheVocabularyFailTheRequest) {
  fake_.model.set_name("smollm2-135m");
  fake_.model.set_vocab_size(49152);
  fake_.bad_ids = {"replay-0"};
  auto source = ContextTokenSource::Create(PositionCorpus(2000));
  ASSERT_TRUE(source.ok());
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  options.tokens = &*source;
  auto report = RunReplay(ApplyCaps(Trace(2, 0), {0, 1000, 2}), options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 1);
  EXPECT_EQ(report->failures_by_code, (std::map<std::string, int64_t>{{"MALFORMED_STREAM", 1}}));
  EXPECT_NE(report->first_error.find("token id 49152"), std::string::npos) << report->first_error;
}

TEST_F(FakeCoordinatorTest, ModelMismatchesAreRefusedBeforeAnyRequest) {
  auto source = ContextTokenSource::Create(PositionCorpus(2000));
  ASSERT_TRUE(source.ok());
  ReplayOptions options;
  options.coordinator = address_;
  options.time_scale = 0;
  // Real text for the pattern model (GetLoad names it, with no vocabulary).
  fake_.model.set_name("pattern");
  options.tokens = &*source;
  auto pattern = RunReplay(ApplyCaps(Trace(1, 0), {0, 600, 1}), options);
  EXPECT_EQ(pattern.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pattern.status().message().find("without --model smollm2"), std::string::npos)
      << pattern.status();
  // No tokens for a real model.
  fake_.model.set_name("smollm2-135m");
  fake_.model.set_vocab_size(49152);
  options.tokens = nullptr;
  auto refused = RunReplay(ApplyCaps(Trace(1, 0), {0, 600, 1}), options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("--model smollm2"), std::string::npos)
      << refused.status();
  // A corpus beyond the vocabulary.
  fake_.model.set_vocab_size(1000);
  options.tokens = &*source;
  options.token_file = "other.npy";
  auto beyond = RunReplay(ApplyCaps(Trace(1, 0), {0, 600, 1}), options);
  EXPECT_EQ(beyond.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(beyond.status().message().find("other.npy holds token id 1999"), std::string::npos)
      << beyond.status();
  EXPECT_TRUE(fake_.received().empty());  // nothing was sent
}

// Runs the `dsa` binary; its exit code.
int RunDsa(const std::vector<std::string>& args) {
  std::string command = DSA_BINARY;
  for (const std::string& arg : args) command += " '" + arg + "'";
  command += " >/dev/null 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(FakeCoordinatorTest, BinaryExitStatusIsNonZeroOnlyWhenARequestFailed) {
  const std::filesystem::path dir = ::testing::TempDir();
  const std::string trace = (dir / "replay_test_trace.jsonl").string();
  {
    std::ofstream out(trace);
    for (int i = 0; i < 5; ++i) {
      out << "{\"timestamp\": " << i << ", \"input_length\": 1000, \"output_length\": 3, "
          << "\"hash_ids\": [0, " << i + 1 << "]}\n";
    }
  }
  const std::string json = (dir / "replay_test_report.json").string();
  EXPECT_EQ(RunDsa({"replay", "--trace", trace, "--coordinator", address_, "--time-scale", "0",
                    "--json", json}),
            0);
  {
    std::ifstream in(json);
    const nlohmann::json report = nlohmann::json::parse(in);
    EXPECT_EQ(report["requests"]["completed"], 5);
    EXPECT_EQ(report["throughput"]["generated_tokens"], 15);
    EXPECT_EQ(report["settings"]["draft_length"], 2);  // the default
  }
  fake_.refuse = {"replay-1"};
  EXPECT_EQ(RunDsa({"replay", "--trace", trace, "--coordinator", address_, "--time-scale", "0",
                    "--json", json}),
            1);
  {
    std::ifstream in(json);
    const nlohmann::json report = nlohmann::json::parse(in);
    EXPECT_EQ(report["requests"]["failed"], 1);
    EXPECT_EQ(report["requests"]["failures_by_code"]["RESOURCE_EXHAUSTED"], 1);
  }
  // Usage errors: neither --coordinator nor --local; both; a running coordinator with the flags
  // of a --local cluster, which would be ignored.
  EXPECT_NE(RunDsa({"replay", "--trace", trace}), 0);
  EXPECT_NE(RunDsa({"replay", "--trace", trace, "--local", "--coordinator", address_}), 0);
  const size_t replays = fake_.received().size();
  for (const std::vector<std::string>& local_only : {std::vector<std::string>{"--indexers", "7"},
                                                     {"--indexer-device", "cuda"},
                                                     {"--audit-fraction", "0.5"},
                                                     {"--coordinator-arg", "--top-k=8"}}) {
    std::vector<std::string> args = {"replay", "--trace",      trace, "--coordinator",
                                     address_, "--time-scale", "0"};
    args.insert(args.end(), local_only.begin(), local_only.end());
    EXPECT_EQ(RunDsa(args), 2) << local_only[0];
  }
  EXPECT_EQ(fake_.received().size(), replays);  // refused before any request
}

}  // namespace
}  // namespace dsa
