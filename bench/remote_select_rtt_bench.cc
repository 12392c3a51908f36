// The per-layer select round trip against a running dsa-indexer in another process (the
// indexer worker on its own GPU), through the attention worker's own IndexerClients, one per data
// plane, interleaved per iteration so that load hits all alike:
//   grpc: the SelectStream (GrpcIndexerClient, as dsa-attention --transport grpc)
//   nccl: the NCCL data plane bootstrapped over the same indexer's gRPC channel
//         (NcclIndexerClientFactory, as dsa-attention --transport nccl; this process's GPU is
//         --cuda-device; needs a build with NCCL and the indexer on another GPU: NCCL refuses two
//         ranks on one)
// Each iteration is one full layer of a decode step of R requests: R sequences of one row each
// (indexer query fp32 [H, D], head weights fp32 [H], one new index key fp32 [1, D] per row), sent
// by Submit and collected by Await; the answer is the indexer's real select (int32 [1, K] per row),
// so the round trip is the data plane plus the indexer's select on its device. Every R of --rows
// is one block; its R sequences per data plane are made through the control plane (CreateSequence
// and an append of --context-slots keys, untimed) and made again every --steps-per-sequence
// iterations so the context stays at --context-slots .. + steps.
// Prints a markdown table (p50, p90, p99, mean in microseconds per data plane and R); --json FILE
// writes the same, --out FILE the table.
#include <unistd.h>

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
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/percentile.h"
#include "nlohmann/json.hpp"
#include "transport/grpc_indexer_client.h"
#include "transport/indexer_client.h"
#ifdef DSA_WITH_NCCL
#include "transport/nccl_indexer_client.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;

// Bound on every control-plane call and on each select's Await.
constexpr absl::Duration kCallTimeout = absl::Seconds(30);

using dsa::bench::Percentile;

// One data plane's client and the sequences of the current block.
struct Plane {
  std::string name;
  std::shared_ptr<dsa::IndexerClient> client;
  std::vector<uint64_t> sequence_ids;
  std::vector<int64_t> positions;  // each sequence's slot count (first_position of its next row)
  std::vector<double> samples;     // microseconds, this block's timed iterations
};

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "bench_remote_select_rtt: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-layer select round trip against a running dsa-indexer (gRPC stream, NCCL)"};
  std::string indexer;
  std::vector<std::string> planes_wanted = {"grpc"};
  std::vector<int> rows_list = {1, 8, 64};
  int cuda_device = 0;
  int iterations = 2000;
  int warmup = 200;
  int context_slots = 1024;
  int steps_per_sequence = 256;
  int top_k = 2048;
  std::string json_path;
  std::string out_path;
  app.add_option("--indexer", indexer, "The dsa-indexer's host:port")->required();
  app.add_option("--transports", planes_wanted, "Data planes, interleaved: grpc, nccl")
      ->delimiter(',')
      ->check(CLI::IsMember({"grpc", "nccl"}))
      ->capture_default_str();
  app.add_option("--rows", rows_list, "R: rows (sequences of one row) per layer, one block each")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--cuda-device", cuda_device, "nccl: this (the attention) side's GPU")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--iterations", iterations, "Timed layers per R")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed layers per R first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--context-slots", context_slots, "Slots of a fresh sequence (index keys)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps-per-sequence", steps_per_sequence, "Layers before fresh sequences")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--top-k", top_k, "K of every sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--json", json_path, "Write the percentiles here");
  app.add_option("--out", out_path, "Write the markdown table here");
  CLI11_PARSE(app, argc, argv);

  auto grpc_client = dsa::GrpcIndexerClient::Factory()(indexer);
  if (!grpc_client.ok()) return Fail("--indexer", grpc_client.status());
  auto shape = (*grpc_client)->GetShape(absl::Now() + kCallTimeout);
  if (!shape.ok()) return Fail("GetShape", shape.status());

  std::vector<Plane> planes;
  for (const std::string& name : planes_wanted) {
    Plane& plane = planes.emplace_back();
    plane.name = name;
    if (name == "grpc") {
      plane.client = *grpc_client;
      continue;
    }
#ifdef DSA_WITH_NCCL
    dsa::NcclConnectOptions options;
    options.link.cuda_device = cuda_device;
    options.num_heads = shape->num_heads;
    options.head_dim = shape->head_dim;
    options.attention_worker = absl::StrCat("bench_remote_select_rtt pid ", getpid());
    auto client = dsa::NcclIndexerClientFactory(options)(indexer);
    if (!client.ok()) return Fail("nccl client", client.status());
    plane.client = *std::move(client);
#else
    return Fail(
        "--transports nccl",
        absl::FailedPreconditionError("this bench was built without NCCL (configure with "
                                      "-DDSA_ENABLE_CUDA=ON where nvcc and NCCL are installed)"));
#endif
  }

  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  // Ids unique over the run and apart from what other clients of the indexer use.
  uint64_t next_id = (static_cast<uint64_t>(getpid()) << 32) + 1;
  auto release_all = [&](Plane& plane) {
    for (uint64_t id : plane.sequence_ids) {
      (void)plane.client->Release(id, absl::Now() + kCallTimeout);
    }
    plane.sequence_ids.clear();
    plane.positions.clear();
  };
  auto fresh_sequences = [&](Plane& plane, int rows) -> absl::Status {
    release_all(plane);
    const std::vector<float> keys = random(static_cast<size_t>(context_slots) * shape->head_dim);
    for (int r = 0; r < rows; ++r) {
      dsa::IndexerSequenceSpec spec;
      spec.sequence_id = next_id++;
      spec.options.top_k = top_k;
      spec.options.spin.enabled = true;
      if (absl::Status s = plane.client->CreateSequence(spec, absl::Now() + kCallTimeout);
          !s.ok()) {
        return s;
      }
      plane.sequence_ids.push_back(spec.sequence_id);
      plane.positions.push_back(context_slots);
      std::unique_ptr<dsa::IndexKeyAppend> append =
          plane.client->BeginAppend(spec.sequence_id, absl::Now() + kCallTimeout);
      (void)append->Write(/*layer=*/0, /*first_slot=*/0, keys, context_slots);
      absl::StatusOr<int64_t> appended = append->Finish();
      if (!appended.ok()) return appended.status();
    }
    return absl::OkStatus();
  };

  nlohmann::json out = {{"indexer", indexer},
                        {"num_heads", shape->num_heads},
                        {"head_dim", shape->head_dim},
                        {"top_k", top_k},
                        {"context_slots", context_slots},
                        {"steps_per_sequence", steps_per_sequence},
                        {"iterations", iterations},
                        {"cuda_device", cuda_device},
                        {"results", nlohmann::json::array()}};
  std::string table =
      "| data plane | rows | p50 us | p90 us | p99 us | mean us |\n|---|---|---|---|---|---|\n";
  for (int rows : rows_list) {
    for (Plane& plane : planes) {
      plane.samples.clear();
      if (absl::Status s = fresh_sequences(plane, rows); !s.ok()) {
        return Fail(absl::StrCat(plane.name, ": making ", rows, " sequences"), s);
      }
    }
    for (int it = 0; it < warmup + iterations; ++it) {
      for (Plane& plane : planes) {
        if (plane.positions[0] - context_slots >= steps_per_sequence) {
          if (absl::Status s = fresh_sequences(plane, rows); !s.ok()) {
            return Fail(absl::StrCat(plane.name, ": making ", rows, " sequences"), s);
          }
        }
        dsa::LayerSelectRequest request;
        request.num_heads = shape->num_heads;
        request.head_dim = shape->head_dim;
        for (int r = 0; r < rows; ++r) {
          dsa::SelectRowGroup& group = request.groups.emplace_back();
          group.sequence_id = plane.sequence_ids[r];
          group.layer = 0;
          group.first_position = plane.positions[r];
          group.num_rows = 1;
          group.queries = random(static_cast<size_t>(shape->num_heads) * shape->head_dim);
          group.head_weights.assign(shape->num_heads, 1.0f / static_cast<float>(shape->num_heads));
          group.new_index_keys = random(shape->head_dim);
        }
        dsa::SelectionTransport& transport = plane.client->Selections();
        const auto start = Clock::now();
        absl::StatusOr<uint64_t> id = transport.Submit(std::move(request));
        absl::Status status = id.status();
        if (id.ok()) status = transport.Await(*id, absl::Now() + kCallTimeout).status();
        const double micros =
            std::chrono::duration<double, std::micro>(Clock::now() - start).count();
        if (!status.ok()) {
          return Fail(
              absl::StrCat(plane.name, ": the select of iteration ", it, " at ", rows, " rows"),
              status);
        }
        for (int64_t& position : plane.positions) ++position;
        if (it >= warmup) plane.samples.push_back(micros);
      }
    }
    for (Plane& plane : planes) {
      double mean = 0;
      for (double s : plane.samples) mean += s;
      mean /= static_cast<double>(plane.samples.size());
      const double p50 = Percentile(plane.samples, 0.5), p90 = Percentile(plane.samples, 0.9),
                   p99 = Percentile(plane.samples, 0.99);
      absl::StrAppendFormat(&table, "| %s | %d | %.1f | %.1f | %.1f | %.1f |\n", plane.name, rows,
                            p50, p90, p99, mean);
      out["results"].push_back({{"data_plane", plane.name},
                                {"rows", rows},
                                {"p50_us", p50},
                                {"p90_us", p90},
                                {"p99_us", p99},
                                {"mean_us", mean}});
    }
  }
  for (Plane& plane : planes) {
    release_all(plane);
    (void)plane.client->Close();
  }
  std::fputs(table.c_str(), stdout);
  if (!out_path.empty()) std::ofstream(out_path) << table;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
