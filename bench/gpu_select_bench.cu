// bench_gpu_select: the whole select on the GPU (indexer_service/cuda/select.h: SPIN's plan, the
// union, the scan, top-K and the EMA update, one stream) replayed from a CUDA graph, at rows x
// slots shapes (one row a sequence, H = 64, D = 128, K = 2048, bf16 queries, tensor-core scan):
// all-keep (every block scored) and SPIN (gamma = 0.05) at rho = 0.4 at every shape and at each
// --rhos value at the --sweep shapes, with the realized block sparsity, against the HBM floor of
// all-keep (132 bytes a slot at the copy bandwidth measured in the same run). The EMAs are primed
// by one all-keep select; the L2 is flushed before each timed run; medians of 30 after 5 warm-ups.
// Up to 2^21 slots each select is also timed with its code warm and its data cold (cw_us: a twin
// problem's select replayed after the flush, before the timed one).
// usage: bench_gpu_select [--shapes 1x16384,...] [--sweep 1x131072] [--rhos 0,0.3,0.4,0.5]
//                         [--json OUT]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/select.h"

namespace {

using dsa::bench::DeviceCopy;
using dsa::bench::DeviceZeros;
using dsa::bench::Split;
using dsa::cuda::SelectPlan;

constexpr int kHeads = 64, kHeadDim = 128, kTopK = 2048;

struct Row {
  int rows;
  int64_t slots;
  double rho;  // < 0: all-keep
  double us, floor_us, sparsity;
  double code_warm_us;  // the same with the code warm and the data cold (NaN: not measured)
};

// One shape's synthetic select (all blocks of `rows` sequences of `slots` slots, one row each, the
// EMAs primed by one all-keep select); owns its device buffers and stream.
struct SelectProblem {
  dsa::bench::DeviceBuffers buffers;
  dsa::cuda::SelectParams p;
  SelectPlan* plan = nullptr;
  cudaStream_t stream = nullptr;
  int rows;

  SelectProblem(int num_rows, int64_t slots) : rows(num_rows) {
    const int64_t blocks = (slots + 63) / 64;
    const int64_t num_blocks = blocks * rows;
    const dsa::bench::SyntheticInputs in =
        dsa::bench::MakeSyntheticInputs(buffers, num_blocks, rows, kHeads, kHeadDim);
    std::vector<int32_t> first_row(rows + 1), tables(num_blocks);
    std::vector<int64_t> table_offset(rows), num_slots(rows, slots), position(rows, slots - 1),
        capacity(rows, slots);
    std::vector<float*> vertical(rows), diagonal(rows);
    std::vector<uint64_t> seeds(rows);
    for (int r = 0; r <= rows; ++r) first_row[r] = r;
    for (int r = 0; r < rows; ++r) {
      table_offset[r] = r * blocks;
      vertical[r] = buffers.Keep(DeviceZeros<float>(slots));
      diagonal[r] = buffers.Keep(DeviceZeros<float>(slots));
      seeds[r] = 0x5eed0000u + r;
    }
    for (int64_t b = 0; b < num_blocks; ++b) tables[b] = static_cast<int32_t>(b);

    p.pool = in.pool;
    p.head_dim = kHeadDim;
    p.num_heads = kHeads;
    p.num_groups = rows;
    p.num_rows = rows;
    p.group_first_row = buffers.Keep(DeviceCopy(first_row));
    p.group_table_offset = buffers.Keep(DeviceCopy(table_offset));
    p.block_tables = buffers.Keep(DeviceCopy(tables));
    p.group_num_slots = buffers.Keep(DeviceCopy(num_slots));
    p.query = in.query;
    p.head_weights = in.weights;
    p.row_position = buffers.Keep(DeviceCopy(position));
    plan = buffers.Keep(DeviceCopy(std::vector<SelectPlan>(rows, SelectPlan::kAllBlocks)));
    p.group_plan = plan;
    p.vertical = buffers.Keep(DeviceCopy(vertical));
    p.diagonal = buffers.Keep(DeviceCopy(diagonal));
    p.spin_capacity = buffers.Keep(DeviceCopy(capacity));
    p.group_seed = buffers.Keep(DeviceCopy(seeds));
    p.top_k = kTopK;
    p.exploration_fraction = 0.05;
    p.max_visible_blocks = blocks;
    p.selection = buffers.Keep(DeviceZeros<int32_t>(int64_t{rows} * kTopK));
    p.scores = buffers.Keep(DeviceZeros<float>(num_blocks * 64));
    p.row_score_offset = buffers.Keep(DeviceZeros<int64_t>(rows));
    p.group_blocks = buffers.Keep(DeviceZeros<int32_t>(num_blocks));
    p.group_block_offset = buffers.Keep(DeviceZeros<int64_t>(rows + 1));
    p.workspace_bytes = dsa::cuda::SelectScratchBytes(p);
    p.workspace = buffers.Keep(DeviceZeros<uint8_t>(p.workspace_bytes));
    const char* why = "";
    if (!dsa::cuda::CanImplementSelect(p, &why)) {
      std::fprintf(stderr, "select %dx%lld: %s\n", rows, static_cast<long long>(slots), why);
      std::exit(1);
    }
    // The memsets of DeviceZeros ran on the default stream, which a non-blocking stream does not
    // wait for.
    DSA_BENCH_CUDA(cudaDeviceSynchronize());
    DSA_BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DSA_BENCH_CUDA(dsa::cuda::LaunchSelect(p, stream));  // primes V and D (a warm-up select)
    DSA_BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  ~SelectProblem() { DSA_BENCH_CUDA(cudaStreamDestroy(stream)); }
  SelectProblem(const SelectProblem&) = delete;
  SelectProblem& operator=(const SelectProblem&) = delete;

  // The select graph of all-keep (rho < 0) or SPIN at rho, captured on this problem's stream.
  cudaGraphExec_t Capture(double rho) {
    const SelectPlan mode = rho < 0 ? SelectPlan::kAllBlocks : SelectPlan::kSpin;
    DSA_BENCH_CUDA(cudaMemcpy(plan, std::vector<SelectPlan>(rows, mode).data(),
                              sizeof(SelectPlan) * rows, cudaMemcpyHostToDevice));
    p.target_block_sparsity = rho < 0 ? 0.0 : rho;
    p.host_all_blocks = mode == SelectPlan::kAllBlocks;
    p.host_no_all_blocks = mode == SelectPlan::kSpin;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DSA_BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    DSA_BENCH_CUDA(dsa::cuda::LaunchSelect(p, stream));
    DSA_BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    DSA_BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    DSA_BENCH_CUDA(cudaGraphDestroy(graph));
    return exec;
  }
};

// Times all-keep and SPIN at `rhos` for one shape; appends a Row each.
void RunShape(int rows, int64_t slots, const std::vector<double>& rhos, double copy_tb_s,
              const dsa::bench::L2Flush& flush, std::vector<Row>& out) {
  SelectProblem problem(rows, slots);
  std::unique_ptr<SelectProblem> twin;
  if (int64_t{rows} * slots <= dsa::bench::kMaxTwinSlots)
    twin = std::make_unique<SelectProblem>(rows, slots);
  const int64_t num_blocks = (slots + 63) / 64 * rows;
  const double floor_us = rows * slots * 132.0 / (copy_tb_s * 1e6);
  std::vector<double> modes = {-1.0};
  modes.insert(modes.end(), rhos.begin(), rhos.end());
  for (double rho : modes) {
    cudaStream_t stream = problem.stream;
    const cudaGraphExec_t exec = problem.Capture(rho);
    const double us =
        dsa::bench::MedianUs([&] { return cudaGraphLaunch(exec, stream); }, flush, stream);
    int64_t scored = 0;
    DSA_BENCH_CUDA(cudaMemcpy(&scored, problem.p.group_block_offset + rows, sizeof(int64_t),
                              cudaMemcpyDeviceToHost));
    double code_warm_us = NAN;
    if (twin != nullptr) {
      // The twin's select (same kernels and paths, its own buffers) after the flush, on this
      // stream: the code is in L2, the timed select's data is not.
      const cudaGraphExec_t twin_exec = twin->Capture(rho);
      code_warm_us =
          dsa::bench::MedianUs([&] { return cudaGraphLaunch(exec, stream); }, flush, stream, 30, 5,
                               [&] { return cudaGraphLaunch(twin_exec, stream); });
      DSA_BENCH_CUDA(cudaGraphExecDestroy(twin_exec));
    }
    out.push_back({rows, slots, rho, us, floor_us, 1.0 - static_cast<double>(scored) / num_blocks,
                   code_warm_us});
    DSA_BENCH_CUDA(cudaGraphExecDestroy(exec));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "1x16384,1x65536,1x131072,1x1048576,8x65536,64x65536";
  std::string sweep = "1x131072", rho_list = "0,0.3,0.4,0.5";
  const char* json_path = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0) shapes = argv[i + 1];
    if (std::strcmp(argv[i], "--sweep") == 0) sweep = argv[i + 1];
    if (std::strcmp(argv[i], "--rhos") == 0) rho_list = argv[i + 1];
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
  }
  std::vector<double> rhos;
  for (const std::string& r : Split(rho_list)) rhos.push_back(std::atof(r.c_str()));
  const std::vector<std::string> sweep_shapes = Split(sweep);
  const dsa::bench::L2Flush flush;
  const double copy_tb_s = dsa::bench::CopyBandwidthTBs(flush);
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", copy_tb_s);
  std::vector<Row> rows_out;
  for (const std::string& shape : Split(shapes)) {
    const dsa::bench::Shape parsed = dsa::bench::ParseShape(shape);
    const int rows = parsed.rows;
    const int64_t slots = parsed.slots;
    bool swept = false;
    for (const std::string& s : sweep_shapes) swept = swept || s == shape;
    RunShape(rows, slots, swept ? rhos : std::vector<double>{0.4}, copy_tb_s, flush, rows_out);
  }
  std::printf("%5s %8s %6s %10s %10s %8s %10s %10s %10s %10s\n", "rows", "slots", "rho",
              "select_us", "floor_us", "x_floor", "vs_allkeep", "sparsity", "cw_us", "cw_vs_keep");
  double all_keep = 0, all_keep_code_warm = 0;
  for (const Row& r : rows_out) {
    if (r.rho < 0) {
      all_keep = r.us;
      all_keep_code_warm = r.code_warm_us;
    }
    std::printf("%5d %8lld %6s %10.1f %10.1f %8.2f %10.3f %10.3f %10.1f %10.3f\n", r.rows,
                static_cast<long long>(r.slots),
                r.rho < 0 ? "keep" : std::to_string(r.rho).substr(0, 4).c_str(), r.us, r.floor_us,
                r.us / r.floor_us, r.us / all_keep, r.sparsity, r.code_warm_us,
                r.code_warm_us / all_keep_code_warm);
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) return 1;
    std::fprintf(f, "{\"copy_tb_s\": %.4f, \"results\": [\n", copy_tb_s);
    for (size_t i = 0; i < rows_out.size(); ++i) {
      const Row& r = rows_out[i];
      std::fprintf(f,
                   " {\"rows\": %d, \"slots\": %lld, \"mode\": \"%s\", \"rho\": %.2f, "
                   "\"select_us\": %.2f, \"floor_us\": %.2f, \"realized_sparsity\": %.4f, "
                   "\"select_code_warm_us\": %s}%s\n",
                   r.rows, static_cast<long long>(r.slots), r.rho < 0 ? "all-keep" : "spin",
                   r.rho < 0 ? 0.0 : r.rho, r.us, r.floor_us, r.sparsity,
                   dsa::bench::JsonNumber(r.code_warm_us).c_str(),
                   i + 1 < rows_out.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
