// The per-layer round trip of a decode step on the gRPC SelectStream over loopback (DESIGN.md 7:
// <= 50 us p50), against the same select run in-process without gRPC, measured in one run.
//
// A real dsa-indexer service (IndexerServiceImpl over an Indexer) listens on 127.0.0.1; the client
// is the attention worker's GrpcStreamTransport. Each iteration sends what one full layer of a
// decode step sends: one row (indexer query fp32 [H, D], head weights fp32 [H]) and its new index
// key fp32 [1, D], and waits for the selection int32 [1, K]. The sequence is recreated every
// --steps-per-sequence iterations (not timed) so the context stays at --context-slots .. + steps.
// Modes, interleaved per iteration so machine load hits all alike:
//   engine:     RunLayerSelect on the service's engine directly (append, score, top-K)
//   in_process: Submit + Await on the in-process transport (the same plus a thread handoff)
//   stream:     Submit + Await on the SelectStream (the same work plus gRPC both ways)
//   unary:      the unary Select RPC
// Prints a markdown table; --json FILE writes the samples' percentiles.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/percentile.h"
#include "grpcpp/grpcpp.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/layer_select.h"
#include "nlohmann/json.hpp"
#include "proto/indexer_codec.h"
#include "proto/tensor_codec.h"
#include "transport/grpc_stream_transport.h"
#include "transport/in_process_transport.h"

namespace {

namespace v1 = dsa::indexer::v1;
using Clock = std::chrono::steady_clock;

using dsa::bench::Percentile;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-layer select round trip on the gRPC SelectStream over loopback"};
  int iterations = 3000;
  int warmup = 300;
  int context_slots = 1024;
  int steps_per_sequence = 256;
  int num_heads = 64;
  int head_dim = 128;
  int top_k = 2048;
  std::string json_path;
  app.add_option("--iterations", iterations, "Timed iterations per mode")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed iterations first")->capture_default_str();
  app.add_option("--context-slots", context_slots, "Slots of a fresh sequence")
      ->capture_default_str();
  app.add_option("--steps-per-sequence", steps_per_sequence, "Decode steps before a fresh one")
      ->capture_default_str();
  app.add_option("--num-heads", num_heads, "H")->capture_default_str();
  app.add_option("--head-dim", head_dim, "D")->capture_default_str();
  app.add_option("--top-k", top_k, "K")->capture_default_str();
  app.add_option("--json", json_path, "Write the results as JSON here");
  CLI11_PARSE(app, argc, argv);

  constexpr int kNumModes = 4;
  const int64_t capacity = kNumModes * (context_slots + steps_per_sequence + 64) / 64 + 16;
  auto indexer = dsa::Indexer::Create({capacity, num_heads, head_dim});
  if (!indexer.ok()) {
    std::fprintf(stderr, "%s\n", indexer.status().ToString().c_str());
    return 1;
  }
  dsa::IndexerServiceImpl service(indexer->get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return 1;
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = v1::IndexerService::NewStub(channel);
  dsa::GrpcStreamTransport transport(channel);
  dsa::InProcessSelectionTransport in_process(indexer->get());

  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  // One sequence per mode, each recreated every steps_per_sequence iterations.
  const char* kModes[kNumModes] = {"engine", "in_process", "stream", "unary"};
  std::vector<int64_t> positions(kNumModes, 0);
  uint64_t next_id = 1;
  std::vector<uint64_t> ids(kNumModes, 0);
  auto fresh_sequence = [&](int mode) {
    if (ids[mode] != 0) (void)(*indexer)->Release(ids[mode]);
    ids[mode] = next_id++;
    dsa::SequenceOptions options;
    options.top_k = top_k;
    options.spin.enabled = true;
    (void)(*indexer)->CreateSequence(ids[mode], options);
    const std::vector<float> keys = random(static_cast<size_t>(context_slots) * head_dim);
    (void)(*indexer)->AppendIndexKeys(ids[mode], 0, keys, context_slots);
    positions[mode] = context_slots;
  };
  for (int mode = 0; mode < kNumModes; ++mode) fresh_sequence(mode);
  auto make_request = [&](int mode) {
    dsa::LayerSelectRequest request;
    request.num_heads = num_heads;
    request.head_dim = head_dim;
    dsa::SelectRowGroup& group = request.groups.emplace_back();
    group.sequence_id = ids[mode];
    group.layer = 0;
    group.first_position = positions[mode];
    group.num_rows = 1;
    group.queries = random(static_cast<size_t>(num_heads) * head_dim);
    group.head_weights.assign(num_heads, 1.0f / static_cast<float>(num_heads));
    group.new_index_keys = random(head_dim);
    return request;
  };

  std::vector<std::vector<double>> samples(kNumModes);
  for (int it = 0; it < warmup + iterations; ++it) {
    for (int mode = 0; mode < kNumModes; ++mode) {
      if (positions[mode] - context_slots >= steps_per_sequence) fresh_sequence(mode);
      dsa::LayerSelectRequest request = make_request(mode);
      // The unary RPC's message is built before the clock starts (the stream encodes in Submit).
      const v1::SelectRequest proto = dsa::EncodeSelectRequest(request);
      v1::SelectResponse response;
      const auto start = Clock::now();
      bool ok = false;
      if (mode == 0) {
        ok = dsa::RunLayerSelect(**indexer, request).ok();
      } else if (mode == 1 || mode == 2) {
        dsa::SelectionTransport& t =
            mode == 1 ? static_cast<dsa::SelectionTransport&>(in_process) : transport;
        auto id = t.Submit(std::move(request));
        ok = id.ok() && t.Await(*id, absl::Now() + absl::Seconds(10)).ok();
      } else {
        grpc::ClientContext context;
        ok = stub->Select(&context, proto, &response).ok();
      }
      const double micros = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!ok) {
        std::fprintf(stderr, "%s: the select failed at iteration %d\n", kModes[mode], it);
        return 1;
      }
      ++positions[mode];
      if (it >= warmup) samples[mode].push_back(micros);
    }
  }
  (void)transport.Close();
  (void)in_process.Close();
  server->Shutdown();

  nlohmann::json out = {{"iterations", iterations},
                        {"context_slots", context_slots},
                        {"steps_per_sequence", steps_per_sequence},
                        {"num_heads", num_heads},
                        {"head_dim", head_dim},
                        {"top_k", top_k},
                        {"modes", nlohmann::json::object()}};
  std::printf("| mode | p50 us | p90 us | p99 us | mean us |\n|---|---|---|---|---|\n");
  for (int mode = 0; mode < kNumModes; ++mode) {
    double mean = 0;
    for (double s : samples[mode]) mean += s;
    mean /= static_cast<double>(samples[mode].size());
    const double p50 = Percentile(samples[mode], 0.5), p90 = Percentile(samples[mode], 0.9),
                 p99 = Percentile(samples[mode], 0.99);
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f |\n", kModes[mode], p50, p90, p99, mean);
    out["modes"][kModes[mode]] = {
        {"p50_us", p50}, {"p90_us", p90}, {"p99_us", p99}, {"mean_us", mean}};
  }
  const double overhead = out["modes"]["stream"]["p50_us"].get<double>() -
                          out["modes"]["engine"]["p50_us"].get<double>();
  out["stream_overhead_p50_us"] = overhead;
  std::printf(
      "\nstream p50 - engine p50 (what gRPC adds to a layer's round trip): %.1f us "
      "(DESIGN.md 7 target for the round trip: <= 50 us p50)\n",
      overhead);
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
