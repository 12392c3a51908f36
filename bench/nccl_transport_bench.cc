// The per-layer round trip of the NCCL data plane on one GPU (the loopback link: a one-rank
// communicator, self send/recv), against the host-only part of the same exchange, in one run.
//
// Each iteration is one full layer of a decode step: R rows (indexer queries fp32 [R, H, D], head
// weights fp32 [R, H]) and one new index key per row, for R sequences of one row each, sent by
// NcclSelectionTransport::Submit and collected by Await; the indexer side is NcclSelectionServer
// with an echo handler that returns precomputed selections int32 [1, K] per group, so the time is
// the data plane's alone (the select's own time is the indexer's, see bench_gpu_select). Modes,
// interleaved per iteration:
//   wire: pack the request, unpack it, pack the answer, unpack it, on the host (no GPU): the floor
//         of what the NCCL path adds to it (staging copies, kernels, event polls)
//   nccl: Submit + Await over the loopback link (pack, H2D, ncclSend/ncclRecv of header and
//         payload, D2H, unpack, answer, H2D, send/recv, D2H, unpack)
// Prints a markdown table; --out FILE writes it, --json FILE the percentiles.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "transport/nccl_comm_impl.h"
#include "transport/nccl_server.h"
#include "transport/nccl_transport.h"
#include "transport/nccl_wire.h"

namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Percentile(std::vector<double> samples, double p) {
  std::sort(samples.begin(), samples.end());
  const size_t index = std::min(samples.size() - 1, static_cast<size_t>(p * samples.size()));
  return samples[index];
}

dsa::LayerSelectRequest MakeRequest(int rows, int heads, int dim, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  dsa::LayerSelectRequest request;
  request.num_heads = heads;
  request.head_dim = dim;
  for (int r = 0; r < rows; ++r) {
    dsa::SelectRowGroup& group = request.groups.emplace_back();
    group.sequence_id = 1 + r;
    group.layer = 0;
    group.first_position = 65536;
    group.num_rows = 1;
    group.queries.resize(static_cast<size_t>(heads) * dim);
    group.head_weights.resize(heads);
    group.new_index_keys.resize(dim);
    for (float& v : group.queries) v = normal(rng);
    for (float& v : group.head_weights) v = std::abs(normal(rng));
    for (float& v : group.new_index_keys) v = normal(rng);
  }
  return request;
}

dsa::LayerSelection MakeSelection(int rows, int top_k, std::mt19937& rng) {
  dsa::LayerSelection selection;
  for (int r = 0; r < rows; ++r) {
    dsa::GroupSelection& group = selection.groups.emplace_back();
    group.num_rows = 1;
    group.top_k = top_k;
    group.selections.resize(top_k);
    for (int32_t& slot : group.selections) slot = static_cast<int32_t>(rng() % 65536);
    group.blocks_scored = 1024;
    group.blocks_visible = 1025;
  }
  return selection;
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{"bench_nccl_transport: the NCCL data plane's per-layer round trip on one GPU"};
  std::string rows_list = "1,8,64";
  int heads = 64, dim = 128, top_k = 2048, iterations = 2000, warmup = 200, device = 0;
  std::string out_path, json_path;
  app.add_option("--rows", rows_list, "Rows per layer (comma-separated)")->capture_default_str();
  app.add_option("--num-heads", heads, "H")->capture_default_str();
  app.add_option("--head-dim", dim, "D")->capture_default_str();
  app.add_option("--top-k", top_k, "K of every selection")->capture_default_str();
  app.add_option("--iterations", iterations, "Timed layers per shape")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed layers per shape first")->capture_default_str();
  app.add_option("--cuda-device", device, "GPU")->capture_default_str();
  app.add_option("--out", out_path, "Write the markdown table here");
  app.add_option("--json", json_path, "Write the percentiles here");
  CLI11_PARSE(app, argc, argv);

  auto link = dsa::CreateLoopbackNcclLink({.cuda_device = device});
  if (!link.ok()) {
    std::fprintf(stderr, "loopback link: %s\n", link.status().ToString().c_str());
    return 1;
  }
  dsa::WireLimits limits;
  limits.max_top_k = top_k;
  limits.max_message_bytes = int64_t{256} << 20;
  std::mt19937 rng(17);
  std::vector<int> shapes;
  for (absl::string_view r : absl::StrSplit(rows_list, ','))
    shapes.push_back(std::stoi(std::string(r)));
  int max_rows = 0;
  for (int r : shapes) max_rows = std::max(max_rows, r);
  // The echo indexer: answers every request with the precomputed selection of its row count.
  std::vector<dsa::LayerSelection> answers(max_rows + 1);
  for (int r : shapes) answers[r] = MakeSelection(r, top_k, rng);
  dsa::NcclServerOptions server_options;
  server_options.limits = limits;
  auto server = dsa::NcclSelectionServer::StartWithHandler(
      [&](const dsa::LayerSelectRequest& request, int*) {
        return absl::StatusOr<dsa::LayerSelection>(answers[request.groups.size()]);
      },
      *link, server_options);
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  dsa::NcclTransportOptions transport_options;
  transport_options.limits = limits;
  dsa::NcclSelectionTransport transport(*link, transport_options);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);

  nlohmann::json json;
  json["gpu"] = prop.name;
  json["nccl_version"] = nccl_version;
  json["num_heads"] = heads;
  json["head_dim"] = dim;
  json["top_k"] = top_k;
  json["iterations"] = iterations;
  std::string table = absl::StrCat(
      "| rows | request bytes | answer bytes | wire p50 (us) | NCCL p50 (us) | NCCL p99 (us) | "
      "NCCL mean (us) | NCCL - wire p50 (us) |\n|---|---|---|---|---|---|---|---|\n");
  for (int rows : shapes) {
    const dsa::LayerSelectRequest request = MakeRequest(rows, heads, dim, rng);
    const auto sizes = dsa::SizeWireRequest(request, limits);
    if (!sizes.ok()) {
      std::fprintf(stderr, "rows %d: %s\n", rows, sizes.status().ToString().c_str());
      return 1;
    }
    std::vector<uint8_t> message(dsa::kWireHeaderBytes + sizes->payload_bytes);
    std::vector<uint8_t> answer(sizes->response_bytes);
    std::vector<double> wire, nccl;
    for (int i = 0; i < warmup + iterations; ++i) {
      // wire: both sides' host work of one exchange.
      Clock::time_point start = Clock::now();
      dsa::PackWireRequest(request, i, *sizes, message);
      const auto header = dsa::DecodeWireHeader(message, limits);
      dsa::AnswerWireRequest(
          [&](const dsa::LayerSelectRequest& seen, int*) {
            return absl::StatusOr<dsa::LayerSelection>(answers[seen.groups.size()]);
          },
          *header, std::span<const uint8_t>(message).subspan(dsa::kWireHeaderBytes), limits,
          answer);
      const auto answer_header = dsa::DecodeWireHeader(answer, limits);
      const auto unpacked = dsa::UnpackWireSelection(
          *answer_header, std::span<const uint8_t>(answer).subspan(dsa::kWireHeaderBytes), limits);
      const double wire_us = Micros(Clock::now() - start);
      if (!unpacked.ok()) {
        std::fprintf(stderr, "wire: %s\n", unpacked.status().ToString().c_str());
        return 1;
      }
      // nccl: the same over the loopback link.
      start = Clock::now();
      auto id = transport.Submit(request);
      absl::StatusOr<dsa::LayerSelection> selection =
          id.ok() ? transport.Await(*id, absl::Now() + absl::Seconds(10)) : id.status();
      const double nccl_us = Micros(Clock::now() - start);
      if (!selection.ok() || selection->groups.size() != static_cast<size_t>(rows) ||
          selection->groups[0].selections != answers[rows].groups[0].selections) {
        std::fprintf(stderr, "nccl rows %d: %s\n", rows,
                     selection.ok() ? "wrong answer" : selection.status().ToString().c_str());
        return 1;
      }
      if (i >= warmup) {
        wire.push_back(wire_us);
        nccl.push_back(nccl_us);
      }
    }
    double mean = 0;
    for (double v : nccl) mean += v / nccl.size();
    const double wire_p50 = Percentile(wire, 0.5), nccl_p50 = Percentile(nccl, 0.5);
    const double nccl_p99 = Percentile(nccl, 0.99);
    absl::StrAppend(&table, "| ", rows, " | ", dsa::kWireHeaderBytes + sizes->payload_bytes, " | ",
                    sizes->response_bytes, " | ", absl::StrFormat("%.1f", wire_p50), " | ",
                    absl::StrFormat("%.1f", nccl_p50), " | ", absl::StrFormat("%.1f", nccl_p99),
                    " | ", absl::StrFormat("%.1f", mean), " | ",
                    absl::StrFormat("%.1f", nccl_p50 - wire_p50), " |\n");
    json["shapes"].push_back({{"rows", rows},
                              {"request_bytes", dsa::kWireHeaderBytes + sizes->payload_bytes},
                              {"answer_bytes", sizes->response_bytes},
                              {"wire_p50_us", wire_p50},
                              {"wire_p99_us", Percentile(wire, 0.99)},
                              {"nccl_p50_us", nccl_p50},
                              {"nccl_p99_us", nccl_p99},
                              {"nccl_mean_us", mean}});
  }
  const absl::Status closed = transport.Close();
  const absl::Status served = (*server)->Wait(absl::Now() + absl::Seconds(10));
  const std::string title = absl::StrCat(
      "bench_nccl_transport on ", prop.name, ", NCCL ", nccl_version, ", H=", heads, ", D=", dim,
      ", K=", top_k, ", ", iterations, " layers per shape (after ", warmup,
      " warm-up); close: ", closed.ToString(), ", server: ", served.ToString(), "\n\n");
  std::printf("%s%s", title.c_str(), table.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << title << table;
  if (!json_path.empty()) std::ofstream(json_path) << json.dump(2) << "\n";
  return closed.ok() && served.ok() ? 0 : 1;
}
