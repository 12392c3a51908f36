// bench_gpu_decode_step: a model's decode step, layer by layer, on one GPU:
// per layer the whole indexer select (indexer_service/cuda/select.h: H = 64, D = 128 fp8 paged
// index keys, K = 2048), the sparse MLA decode over the selection it attends
// (attention_worker/cuda/sparse_mla_decode.h: 128 heads, 576-dim bf16 paged latent) and the layer
// stand-in (attention_worker/cuda/layer_standin.h: a cuBLAS GEMM over the layer's weight bytes and
// a busy spin, its defaults). Every layer is full (retention r = 1), lag depth k = 1 (DESIGN.md
// 4.3: layer l attends sigma(l) = l - 1, layer 0 its own). Arms, each one step of --layers layers:
//   ceiling        attention + stand-in only, attending a fixed valid selection (no indexer);
//   serial_keep    one stream: select(l) all-keep, attention over it, stand-in;
//   serial_spin    the same with SPIN at rho 0.4;
//   mli_keep_eq /  MLI k = 1 all-keep: select(l) on a second stream, forked at the start of layer
//   mli_keep_lo    l, joined by an event at layer l + 1, which attends it (the last layer's select
//                  has no consumer and is not issued); _eq: both streams at the default priority,
//                  _lo: the attention stream at the highest priority, the indexer's at the lowest;
//   spin_mli_eq /  the same with SPIN at rho 0.4;
//   spin_mli_lo
// plus the parts alone over the same layers: indexer_keep / indexer_spin (the selects on one
// stream), attention (the sparse decodes), standin. Selections stay in device memory. Each arm is
// timed from a CUDA graph of one step (the graph holds both streams' work and their event edges)
// and eagerly (launch by launch); per-step time is CUDA events around --steps steps after warm-up,
// median over --reps; the L2 is not flushed between layers or steps. Checks in the same run: every
// attended layer's LSE is finite, and the all-keep arms' selections equal a standalone select's.
// One step of each arm is also recorded with per-layer events on both streams (--json timelines).
// usage: bench_gpu_decode_step [--shapes 1x65536,1x131072,64x65536] [--layers 61] [--steps 3]
//                              [--reps 9] [--rho 0.4] [--eager 1] [--json OUT]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_worker/cuda/layer_standin.h"
#include "attention_worker/cuda/sparse_mla_decode.h"
#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/select.h"

namespace dsa::bench {
namespace {

constexpr int kIndexHeads = 64, kIndexDim = 128, kTopK = 2048, kAttentionHeads = 128;
// Distinct copies of the per-layer caches, so that a layer does not find an earlier layer's data in
// the L2: as many as fit in these bytes (at least one KV pool and two index-key pools).
constexpr int64_t kKvRotationBytes = int64_t{1} << 30;
constexpr int64_t kKeyRotationBytes = int64_t{2} << 30;

// Random bf16 values in [-2, 2) (never NaN).
__global__ void FillBf16(__nv_bfloat16* data, int64_t count, uint64_t salt) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __float2bfloat16((Hash(i * 2654435761ULL + salt) % 4096) * (1.0f / 1024) - 2.0f);
  }
}

enum class Arm {
  kCeiling,
  kSerial,
  kMli,
  kIndexerOnly,
  kAttentionOnly,
  kStandinOnly,
};

struct ArmSpec {
  const char* name;
  Arm arm;
  bool spin;
  bool indexer_low_priority;  // MLI: attention stream high, indexer stream low
  bool late_fork = false;     // MLI: the select forked after the layer's GEMM, not at its start
};

const ArmSpec kArms[] = {
    {"ceiling", Arm::kCeiling, false, false},
    {"attention", Arm::kAttentionOnly, false, false},
    {"standin", Arm::kStandinOnly, false, false},
    {"indexer_keep", Arm::kIndexerOnly, false, false},
    {"serial_keep", Arm::kSerial, false, false},
    {"mli_keep_eq", Arm::kMli, false, false},
    {"mli_keep_lo", Arm::kMli, false, true},
    {"indexer_spin", Arm::kIndexerOnly, true, false},
    {"serial_spin", Arm::kSerial, true, false},
    {"spin_mli_eq", Arm::kMli, true, false},
    {"spin_mli_lo", Arm::kMli, true, true},
    // Ablation: the select of layer l issued after layer l's GEMM (beside the busy part).
    {"mli_keep_late", Arm::kMli, false, false, true},
    {"spin_mli_late", Arm::kMli, true, false, true},
};

// One layer's events of a recorded step (NaN-free only where the arm records them).
struct LayerEvents {
  cudaEvent_t layer_start, attention_start, attention_end, layer_end, select_start, select_end;
};

struct ArmResult {
  std::string name;
  double graph_us = NAN, eager_us = NAN;  // per step
  double realized_sparsity = NAN;
  bool lse_finite = true;
  int selection_mismatches = -1;  // layers whose selections differ from the standalone select
  // The recorded step: per layer, microseconds from the step's start (NaN: not recorded).
  std::vector<std::vector<double>> timeline;
};

// One shape's model: `layers` layers of `rows` sequences of `slots` slots each (one decode row a
// sequence, at position slots - 1), each layer with its own index keys, indexer query, SPIN state,
// KV latent pool and attention query (the caches rotating over distinct copies: see above).
class StepModel {
 public:
  StepModel(int rows, int64_t slots, int layers, double rho) : rows_(rows), layers_(layers) {
    blocks_ = (slots + 63) / 64;
    const int64_t seq_blocks = blocks_ * rows;
    // ---- the indexer ----
    const int64_t key_pool_bytes = seq_blocks * 64 * (kIndexDim + 4);
    key_pools_ = static_cast<int>(std::clamp<int64_t>(
        (kKeyRotationBytes + key_pool_bytes - 1) / key_pool_bytes, 2, std::max(2, layers)));
    uint8_t* keys = buffers_.Keep(DeviceZeros<uint8_t>(key_pool_bytes * key_pools_));
    FillPool<<<2048, 256>>>(keys, seq_blocks * key_pools_, kIndexDim);
    const int64_t query_values = int64_t{layers} * rows * kIndexHeads * kIndexDim;
    auto* index_query = buffers_.Keep(DeviceZeros<__nv_bfloat16>(query_values));
    auto* head_weights = buffers_.Keep(DeviceZeros<float>(int64_t{layers} * rows * kIndexHeads));
    FillQuery<<<1024, 256>>>(index_query, query_values, head_weights,
                             int64_t{layers} * rows * kIndexHeads);
    DSA_BENCH_CUDA(cudaGetLastError());
    std::vector<int32_t> first_row(rows + 1), key_tables(seq_blocks);
    std::iota(first_row.begin(), first_row.end(), 0);
    std::iota(key_tables.begin(), key_tables.end(), 0);
    std::vector<int64_t> table_offset(rows), num_slots(rows, slots), position(rows, slots - 1),
        capacity(rows, slots);
    std::vector<uint64_t> seeds(rows);
    for (int r = 0; r < rows; ++r) {
      table_offset[r] = r * blocks_;
      seeds[r] = 0x5eed0000u + r;
    }
    float* vertical = buffers_.Keep(DeviceZeros<float>(int64_t{layers} * rows * slots));
    float* diagonal = buffers_.Keep(DeviceZeros<float>(int64_t{layers} * rows * slots));
    base_.head_dim = kIndexDim;
    base_.num_heads = kIndexHeads;
    base_.num_groups = rows;
    base_.num_rows = rows;
    base_.group_first_row = buffers_.Keep(DeviceCopy(first_row));
    base_.group_table_offset = buffers_.Keep(DeviceCopy(table_offset));
    base_.block_tables = buffers_.Keep(DeviceCopy(key_tables));
    base_.group_num_slots = buffers_.Keep(DeviceCopy(num_slots));
    base_.row_position = buffers_.Keep(DeviceCopy(position));
    base_.spin_capacity = buffers_.Keep(DeviceCopy(capacity));
    base_.group_seed = buffers_.Keep(DeviceCopy(seeds));
    keep_plan_ = buffers_.Keep(
        DeviceCopy(std::vector<cuda::SelectPlan>(rows, cuda::SelectPlan::kAllBlocks)));
    spin_plan_ =
        buffers_.Keep(DeviceCopy(std::vector<cuda::SelectPlan>(rows, cuda::SelectPlan::kSpin)));
    base_.top_k = kTopK;
    base_.target_block_sparsity = rho;
    base_.exploration_fraction = 0.05;
    base_.max_visible_blocks = blocks_;
    base_.scores = buffers_.Keep(DeviceZeros<float>(seq_blocks * 64));
    base_.row_score_offset = buffers_.Keep(DeviceZeros<int64_t>(rows));
    base_.group_blocks = buffers_.Keep(DeviceZeros<int32_t>(seq_blocks));
    base_.group_block_offset = buffers_.Keep(DeviceZeros<int64_t>(rows + 1));
    selections_ = buffers_.Keep(DeviceZeros<int32_t>(int64_t{layers} * rows * kTopK));
    reference_ = buffers_.Keep(DeviceZeros<int32_t>(int64_t{layers} * rows * kTopK));
    for (int l = 0; l < layers; ++l) {
      cuda::SelectParams p = base_;
      p.pool = keys + (l % key_pools_) * key_pool_bytes;
      p.query = index_query + int64_t{l} * rows * kIndexHeads * kIndexDim;
      p.head_weights = head_weights + int64_t{l} * rows * kIndexHeads;
      std::vector<float*> v(rows), d(rows);
      for (int r = 0; r < rows; ++r) {
        v[r] = vertical + (int64_t{l} * rows + r) * slots;
        d[r] = diagonal + (int64_t{l} * rows + r) * slots;
      }
      p.vertical = buffers_.Keep(DeviceCopy(v));
      p.diagonal = buffers_.Keep(DeviceCopy(d));
      p.layer = l;
      p.selection = selections_ + int64_t{l} * rows * kTopK;
      layer_select_.push_back(p);
    }
    {
      cuda::SelectParams p = SelectFor(0, false);
      base_.workspace_bytes =
          std::max(cuda::SelectScratchBytes(p), cuda::SelectScratchBytes(SelectFor(0, true)));
      base_.workspace = buffers_.Keep(DeviceZeros<uint8_t>(base_.workspace_bytes));
      for (cuda::SelectParams& q : layer_select_) {
        q.workspace = base_.workspace;
        q.workspace_bytes = base_.workspace_bytes;
      }
      for (bool spin : {false, true}) {
        const char* why = "";
        if (!cuda::CanImplementSelect(SelectFor(0, spin), &why)) {
          std::fprintf(stderr, "select %dx%lld: %s\n", rows, static_cast<long long>(slots), why);
          std::exit(1);
        }
      }
    }
    // ---- the attention ----
    const int64_t kv_pool_values = seq_blocks * 64 * kMlaKeyDim;
    const int64_t kv_pool_bytes = kv_pool_values * 2;
    kv_pools_ = static_cast<int>(
        std::clamp<int64_t>((kKvRotationBytes + kv_pool_bytes - 1) / kv_pool_bytes, 1, layers));
    auto* kv = buffers_.Keep(DeviceZeros<__nv_bfloat16>(kv_pool_values * kv_pools_));
    FillBf16<<<4096, 256>>>(kv, kv_pool_values * kv_pools_, 1);
    const int64_t attention_query_values = int64_t{layers} * rows * kAttentionHeads * kMlaKeyDim;
    auto* attention_query = buffers_.Keep(DeviceZeros<__nv_bfloat16>(attention_query_values));
    FillBf16<<<1024, 256>>>(attention_query, attention_query_values, 17);
    DSA_BENCH_CUDA(cudaGetLastError());
    std::mt19937 rng(rows * 7919 + static_cast<uint32_t>(slots));
    std::vector<int32_t> kv_tables(seq_blocks);  // every sequence's blocks all over the pool
    std::iota(kv_tables.begin(), kv_tables.end(), 0);
    std::shuffle(kv_tables.begin(), kv_tables.end(), rng);
    lse_ = buffers_.Keep(DeviceZeros<float>(int64_t{layers} * rows * kAttentionHeads));
    cuda::SparseMlaDecodeParams a;
    a.num_physical_blocks = seq_blocks;
    a.num_rows = rows;
    a.num_heads = kAttentionHeads;
    a.block_tables = buffers_.Keep(DeviceCopy(kv_tables));
    a.max_blocks_per_row = static_cast<int>(blocks_);
    a.num_slots = buffers_.Keep(DeviceCopy(std::vector<int32_t>(rows, int32_t(slots))));
    a.positions = buffers_.Keep(DeviceCopy(std::vector<int32_t>(rows, int32_t(slots - 1))));
    a.top_k = kTopK;
    a.out =
        buffers_.Keep(DeviceZeros<__nv_bfloat16>(int64_t{rows} * kAttentionHeads * kMlaValueDim));
    a.workspace_bytes = cuda::SparseMlaDecodeScratchBytes(a);
    a.workspace = buffers_.Keep(DeviceZeros<uint8_t>(a.workspace_bytes));
    attention_splits_ = cuda::SparseMlaDecodeNumSplits(a);
    for (int l = 0; l < layers; ++l) {
      cuda::SparseMlaDecodeParams p = a;
      p.kv_pool = kv + (l % kv_pools_) * kv_pool_values;
      p.query = attention_query + int64_t{l} * rows * kAttentionHeads * kMlaKeyDim;
      p.lse = lse_ + int64_t{l} * rows * kAttentionHeads;
      layer_attention_.push_back(p);
    }
    // ---- the rest of the layer (the stand-in's calibrated defaults) ----
    // The busy spin is launched here, after the GEMM (as RunLayerStandin does), so that the
    // late-fork ablation can issue its select between the two.
    cuda::LayerStandinParams sp;
    busy_us_ = sp.busy_micros;
    sp.busy_micros = 0;
    sp.max_rows = std::max(256, rows);
    DSA_BENCH_CUDA(cuda::CreateLayerStandin(sp, &standin_));
    // A fixed workspace, so that capturing the GEMM into a graph allocates nothing.
    cublas_workspace_ = buffers_.Keep(DeviceZeros<uint8_t>(size_t{32} << 20));
    if (cublasSetWorkspace(standin_.cublas, cublas_workspace_, size_t{32} << 20) !=
        CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasSetWorkspace failed\n");
      std::exit(1);
    }
    activations_ = buffers_.Keep(DeviceZeros<__nv_bfloat16>(int64_t{rows} * kStandinHidden()));
    FillBf16<<<256, 256>>>(activations_, int64_t{rows} * kStandinHidden(), 5);
    standin_out_ = buffers_.Keep(DeviceZeros<__nv_bfloat16>(int64_t{rows} * standin_.weight_rows));
    DSA_BENCH_CUDA(cudaGetLastError());
    DSA_BENCH_CUDA(cudaDeviceSynchronize());  // the default stream's memsets and fills are done

    // ---- streams and events ----
    int least = 0, greatest = 0;
    DSA_BENCH_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    greatest_priority_ = greatest;
    DSA_BENCH_CUDA(cudaStreamCreateWithPriority(&attention_eq_, cudaStreamNonBlocking, least));
    DSA_BENCH_CUDA(cudaStreamCreateWithPriority(&indexer_eq_, cudaStreamNonBlocking, least));
    DSA_BENCH_CUDA(cudaStreamCreateWithPriority(&attention_hi_, cudaStreamNonBlocking, greatest));
    DSA_BENCH_CUDA(cudaStreamCreateWithPriority(&indexer_lo_, cudaStreamNonBlocking, least));
    input_ready_.resize(layers);
    selection_ready_.resize(layers);
    for (int l = 0; l < layers; ++l) {
      DSA_BENCH_CUDA(cudaEventCreateWithFlags(&input_ready_[l], cudaEventDisableTiming));
      DSA_BENCH_CUDA(cudaEventCreateWithFlags(&selection_ready_[l], cudaEventDisableTiming));
    }
    timeline_.resize(layers);
    for (LayerEvents& e : timeline_) {
      for (cudaEvent_t* ev : {&e.layer_start, &e.attention_start, &e.attention_end, &e.layer_end,
                              &e.select_start, &e.select_end}) {
        DSA_BENCH_CUDA(cudaEventCreate(ev));
      }
    }
    DSA_BENCH_CUDA(cudaEventCreate(&step_start_));

    // The standalone select of every layer (all-keep): the reference selections, which the
    // ceiling attends; it also primes every layer's V and D (a warm-up select).
    for (int l = 0; l < layers; ++l) {
      cuda::SelectParams p = SelectFor(l, false);
      p.selection = reference_ + int64_t{l} * rows * kTopK;
      DSA_BENCH_CUDA(cuda::LaunchSelect(p, attention_eq_));
    }
    DSA_BENCH_CUDA(cudaStreamSynchronize(attention_eq_));
  }

  ~StepModel() {
    DSA_BENCH_CUDA(cudaDeviceSynchronize());
    for (cudaStream_t s : {attention_eq_, indexer_eq_, attention_hi_, indexer_lo_})
      DSA_BENCH_CUDA(cudaStreamDestroy(s));
    for (int l = 0; l < layers_; ++l) {
      DSA_BENCH_CUDA(cudaEventDestroy(input_ready_[l]));
      DSA_BENCH_CUDA(cudaEventDestroy(selection_ready_[l]));
    }
    for (LayerEvents& e : timeline_) {
      for (cudaEvent_t ev : {e.layer_start, e.attention_start, e.attention_end, e.layer_end,
                             e.select_start, e.select_end}) {
        DSA_BENCH_CUDA(cudaEventDestroy(ev));
      }
    }
    DSA_BENCH_CUDA(cudaEventDestroy(step_start_));
    DSA_BENCH_CUDA(cuda::DestroyLayerStandin(&standin_));
  }
  StepModel(const StepModel&) = delete;
  StepModel& operator=(const StepModel&) = delete;

  int key_pools() const { return key_pools_; }
  int kv_pools() const { return kv_pools_; }
  int attention_splits() const { return attention_splits_; }
  int64_t standin_weight_bytes() const { return standin_.params.weight_bytes_per_layer; }
  double standin_busy_us() const { return busy_us_; }

  // Runs, times, checks and records one arm.
  ArmResult Run(const ArmSpec& spec, int steps, int reps, bool eager) {
    ArmResult result;
    result.name = spec.name;
    cudaStream_t attention = spec.indexer_low_priority ? attention_hi_ : attention_eq_;
    cudaStream_t indexer = spec.indexer_low_priority ? indexer_lo_ : indexer_eq_;
    DSA_BENCH_CUDA(cudaMemsetAsync(lse_, 0xff, sizeof(float) * layers_ * rows_ * kAttentionHeads,
                                   attention));  // NaN until an attention writes it
    DSA_BENCH_CUDA(
        cudaMemsetAsync(selections_, 0xff, sizeof(int32_t) * layers_ * rows_ * kTopK, attention));
    Issue(spec, attention, indexer, false);  // warm-up, outside any capture (lazy module loads)
    DSA_BENCH_CUDA(cudaStreamSynchronize(attention));
    CheckOutputs(spec, &result);

    cudaGraph_t graph;
    cudaGraphExec_t exec = Capture(spec, attention, indexer, false, &graph);
    result.graph_us = MedianStepUs([&] { DSA_BENCH_CUDA(cudaGraphLaunch(exec, attention)); },
                                   attention, steps, reps);
    DSA_BENCH_CUDA(cudaGraphExecDestroy(exec));
    DSA_BENCH_CUDA(cudaGraphDestroy(graph));
    if (eager) {
      result.eager_us =
          MedianStepUs([&] { Issue(spec, attention, indexer, false); }, attention, steps, reps);
    }
    if (spec.arm == Arm::kSerial || spec.arm == Arm::kMli || spec.arm == Arm::kIndexerOnly) {
      int64_t scored = 0;
      DSA_BENCH_CUDA(cudaMemcpy(&scored, base_.group_block_offset + rows_, sizeof(int64_t),
                                cudaMemcpyDeviceToHost));
      result.realized_sparsity = 1.0 - static_cast<double>(scored) / (blocks_ * rows_);
    }
    // One recorded step from a graph with event-record nodes, after the timed steps (warm).
    exec = Capture(spec, attention, indexer, true, &graph);
    DSA_BENCH_CUDA(cudaGraphLaunch(exec, attention));
    DSA_BENCH_CUDA(cudaGraphLaunch(exec, attention));
    DSA_BENCH_CUDA(cudaStreamSynchronize(attention));
    result.timeline = ReadTimeline(spec);
    DSA_BENCH_CUDA(cudaGraphExecDestroy(exec));
    DSA_BENCH_CUDA(cudaGraphDestroy(graph));
    return result;
  }

 private:
  // Captures one step into a graph. For the _lo arms the attention stream's kernel nodes get the
  // highest priority as a node attribute (the indexer's keep the default, the lowest), and the
  // graph is instantiated to use node priorities.
  cudaGraphExec_t Capture(const ArmSpec& spec, cudaStream_t attention, cudaStream_t indexer,
                          bool timeline, cudaGraph_t* graph) {
    std::vector<cudaGraphNode_t> attention_nodes;
    if (spec.indexer_low_priority) collect_ = &attention_nodes;
    DSA_BENCH_CUDA(cudaStreamBeginCapture(attention, cudaStreamCaptureModeThreadLocal));
    Issue(spec, attention, indexer, timeline);
    DSA_BENCH_CUDA(cudaStreamEndCapture(attention, graph));
    collect_ = nullptr;
    for (cudaGraphNode_t node : attention_nodes) {
      cudaGraphNodeType type;
      DSA_BENCH_CUDA(cudaGraphNodeGetType(node, &type));
      if (type != cudaGraphNodeTypeKernel) continue;
      cudaLaunchAttributeValue value = {};
      value.priority = greatest_priority_;
      DSA_BENCH_CUDA(cudaGraphKernelNodeSetAttribute(node, cudaLaunchAttributePriority, &value));
    }
    // Without this flag every node runs at the priority of the stream the graph is launched into.
    cudaGraphExec_t exec;
    DSA_BENCH_CUDA(cudaGraphInstantiate(&exec, *graph, cudaGraphInstantiateFlagUseNodePriority));
    return exec;
  }

  static std::vector<cudaGraphNode_t> Nodes(cudaGraph_t graph) {
    size_t count = 0;
    DSA_BENCH_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    DSA_BENCH_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
    std::sort(nodes.begin(), nodes.end());
    return nodes;
  }

  // Runs `launch` on `stream`; while capturing with collect_ set, adds the nodes it made to it.
  template <typename F>
  void Collect(cudaStream_t stream, F launch) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    if (collect_ != nullptr) {
      DSA_BENCH_CUDA(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph));
    }
    if (status != cudaStreamCaptureStatusActive) {
      launch();
      return;
    }
    const std::vector<cudaGraphNode_t> before = Nodes(graph);
    launch();
    const std::vector<cudaGraphNode_t> after = Nodes(graph);
    std::set_difference(after.begin(), after.end(), before.begin(), before.end(),
                        std::back_inserter(*collect_));
  }

  static int kStandinHidden() { return cuda::kStandinHiddenDim; }

  cuda::SelectParams SelectFor(int layer, bool spin) const {
    cuda::SelectParams p = layer_select_[layer];
    p.group_plan = spin ? spin_plan_ : keep_plan_;
    p.host_all_blocks = !spin;
    p.host_no_all_blocks = spin;
    return p;
  }

  void Record(cudaEvent_t event, cudaStream_t stream, bool timeline) {
    if (!timeline) return;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    DSA_BENCH_CUDA(cudaStreamIsCapturing(stream, &status));
    DSA_BENCH_CUDA(cudaEventRecordWithFlags(event, stream,
                                            status == cudaStreamCaptureStatusActive
                                                ? cudaEventRecordExternal
                                                : cudaEventRecordDefault));
  }

  void Attend(int layer, const int32_t* selection, cudaStream_t stream) {
    cuda::SparseMlaDecodeParams p = layer_attention_[layer];
    p.selections = selection;
    Collect(stream, [&] { DSA_BENCH_CUDA(cuda::LaunchSparseMlaDecodeTensorCores(p, stream)); });
  }

  // The stand-in's GEMM, then `between` (the late fork), then its busy spin.
  template <typename F>
  void Standin(cudaStream_t stream, F between) {
    Collect(stream, [&] {
      const cudaError_t error =
          cuda::RunLayerStandin(&standin_, activations_, rows_, standin_out_, stream);
      if (error != cudaSuccess) {
        std::fprintf(stderr, "stand-in: %s (cuBLAS status %d)\n", cudaGetErrorString(error),
                     static_cast<int>(standin_.last_cublas_status));
        std::exit(1);
      }
    });
    between();
    Collect(stream, [&] { DSA_BENCH_CUDA(cuda::LaunchBusySpin(busy_us_, stream)); });
  }

  // Issues one decode step of `spec` on `attention` (and `indexer` for MLI).
  void Issue(const ArmSpec& spec, cudaStream_t attention, cudaStream_t indexer, bool timeline) {
    Record(step_start_, attention, timeline);
    for (int l = 0; l < layers_; ++l) {
      const LayerEvents& e = timeline_[l];
      const auto fork_select = [&] {
        if (l + 1 >= layers_ && layers_ != 1) return;
        DSA_BENCH_CUDA(cudaEventRecord(input_ready_[l], attention));
        DSA_BENCH_CUDA(cudaStreamWaitEvent(indexer, input_ready_[l], 0));
        Record(e.select_start, indexer, timeline);
        DSA_BENCH_CUDA(cuda::LaunchSelect(SelectFor(l, spec.spin), indexer));
        Record(e.select_end, indexer, timeline);
        DSA_BENCH_CUDA(cudaEventRecord(selection_ready_[l], indexer));
      };
      const int32_t* own = selections_ + int64_t{l} * rows_ * kTopK;
      Record(e.layer_start, attention, timeline);
      const int32_t* attended = nullptr;
      switch (spec.arm) {
        case Arm::kCeiling:
        case Arm::kAttentionOnly:
          attended = reference_ + int64_t{l} * rows_ * kTopK;
          break;
        case Arm::kSerial:
        case Arm::kIndexerOnly:
          Record(e.select_start, attention, timeline);
          DSA_BENCH_CUDA(cuda::LaunchSelect(SelectFor(l, spec.spin), attention));
          Record(e.select_end, attention, timeline);
          attended = own;
          break;
        case Arm::kMli: {
          // The select of layer l reads the layer's input, which exists now; its only consumer
          // is layer l + 1 (sigma(l + 1) = l), so the last layer's is not issued. Layer 0 attends
          // its own, so its select is forked at once even in the late-fork ablation.
          if (!spec.late_fork || l == 0) fork_select();
          const int sigma = l == 0 ? 0 : l - 1;  // pi_1(l); the first full layer attends its own
          DSA_BENCH_CUDA(cudaStreamWaitEvent(attention, selection_ready_[sigma], 0));
          attended = selections_ + int64_t{sigma} * rows_ * kTopK;
          break;
        }
        case Arm::kStandinOnly:
          break;
      }
      Record(e.attention_start, attention, timeline);
      if (spec.arm != Arm::kIndexerOnly && spec.arm != Arm::kStandinOnly) {
        Attend(l, attended, attention);
      }
      Record(e.attention_end, attention, timeline);
      if (spec.arm != Arm::kIndexerOnly && spec.arm != Arm::kAttentionOnly) {
        Standin(attention, [&] {
          if (spec.arm == Arm::kMli && spec.late_fork && l > 0) fork_select();
        });
      }
      Record(e.layer_end, attention, timeline);
    }
  }

  template <typename F>
  double MedianStepUs(F step, cudaStream_t stream, int steps, int reps) {
    cudaEvent_t start, stop;
    DSA_BENCH_CUDA(cudaEventCreate(&start));
    DSA_BENCH_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < 2; ++i) step();
    std::vector<float> ms;
    for (int rep = 0; rep < reps; ++rep) {
      DSA_BENCH_CUDA(cudaEventRecord(start, stream));
      for (int s = 0; s < steps; ++s) step();
      DSA_BENCH_CUDA(cudaEventRecord(stop, stream));
      DSA_BENCH_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      DSA_BENCH_CUDA(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t / steps);
    }
    DSA_BENCH_CUDA(cudaEventDestroy(start));
    DSA_BENCH_CUDA(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
  }

  // LSEs finite at every attended layer; the all-keep arms' selections against the reference.
  void CheckOutputs(const ArmSpec& spec, ArmResult* result) {
    if (spec.arm != Arm::kIndexerOnly && spec.arm != Arm::kStandinOnly) {
      std::vector<float> lse(int64_t{layers_} * rows_ * kAttentionHeads);
      DSA_BENCH_CUDA(
          cudaMemcpy(lse.data(), lse_, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
      for (float v : lse) result->lse_finite = result->lse_finite && std::isfinite(v);
    }
    if (spec.spin || spec.arm == Arm::kCeiling || spec.arm == Arm::kAttentionOnly ||
        spec.arm == Arm::kStandinOnly) {
      return;
    }
    const int64_t per_layer = int64_t{rows_} * kTopK;
    std::vector<int32_t> got(per_layer * layers_), want(per_layer * layers_);
    DSA_BENCH_CUDA(cudaMemcpy(got.data(), selections_, got.size() * 4, cudaMemcpyDeviceToHost));
    DSA_BENCH_CUDA(cudaMemcpy(want.data(), reference_, want.size() * 4, cudaMemcpyDeviceToHost));
    const int checked = spec.arm == Arm::kMli && layers_ > 1 ? layers_ - 1 : layers_;
    result->selection_mismatches = 0;
    for (int l = 0; l < checked; ++l) {
      if (std::memcmp(got.data() + l * per_layer, want.data() + l * per_layer, per_layer * 4) != 0)
        ++result->selection_mismatches;
    }
  }

  std::vector<std::vector<double>> ReadTimeline(const ArmSpec& spec) {
    const auto since = [&](cudaEvent_t e) {
      float ms = 0;
      return cudaEventElapsedTime(&ms, step_start_, e) == cudaSuccess ? ms * 1e3 : NAN;
    };
    std::vector<std::vector<double>> out;
    const bool selects =
        spec.arm == Arm::kSerial || spec.arm == Arm::kMli || spec.arm == Arm::kIndexerOnly;
    for (int l = 0; l < layers_; ++l) {
      const LayerEvents& e = timeline_[l];
      const bool has_select = selects && (spec.arm != Arm::kMli || l + 1 < layers_);
      out.push_back({since(e.layer_start), since(e.attention_start), since(e.attention_end),
                     since(e.layer_end), has_select ? since(e.select_start) : NAN,
                     has_select ? since(e.select_end) : NAN});
    }
    cudaGetLastError();  // an unrecorded event's elapsed-time error is not sticky; clear it
    return out;
  }

  int rows_, layers_;
  int64_t blocks_ = 0;
  int key_pools_ = 0, kv_pools_ = 0, attention_splits_ = 0;
  DeviceBuffers buffers_;
  cuda::SelectParams base_;
  std::vector<cuda::SelectParams> layer_select_;
  std::vector<cuda::SparseMlaDecodeParams> layer_attention_;
  cuda::SelectPlan* keep_plan_ = nullptr;
  cuda::SelectPlan* spin_plan_ = nullptr;
  int32_t* selections_ = nullptr;  // int32 [layers, rows, K]: each layer's select output
  int32_t* reference_ = nullptr;   // int32 [layers, rows, K]: the standalone all-keep selects
  float* lse_ = nullptr;           // fp32 [layers, rows, 128]
  cuda::LayerStandin standin_;
  double busy_us_ = 0;  // the stand-in's busy time a layer (its calibrated default)
  int greatest_priority_ = 0;
  std::vector<cudaGraphNode_t>* collect_ = nullptr;  // Capture's attention-stream nodes
  void* cublas_workspace_ = nullptr;
  __nv_bfloat16* activations_ = nullptr;
  __nv_bfloat16* standin_out_ = nullptr;
  cudaStream_t attention_eq_ = nullptr, indexer_eq_ = nullptr, attention_hi_ = nullptr,
               indexer_lo_ = nullptr;
  std::vector<cudaEvent_t> input_ready_, selection_ready_;
  std::vector<LayerEvents> timeline_;
  cudaEvent_t step_start_ = nullptr;
};

const ArmResult& Find(const std::vector<ArmResult>& results, const std::string& name) {
  for (const ArmResult& r : results) {
    if (r.name == name) return r;
  }
  std::fprintf(stderr, "no arm %s\n", name.c_str());
  std::exit(1);
}

}  // namespace
}  // namespace dsa::bench

int main(int argc, char** argv) {
  using namespace dsa::bench;
  std::string shapes = "1x65536,1x131072,64x65536";
  std::string json_path;
  int layers = 61, steps = 3, reps = 9;
  double rho = 0.4;
  bool eager = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0)
      shapes = argv[i + 1];
    else if (std::strcmp(argv[i], "--layers") == 0)
      layers = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--steps") == 0)
      steps = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--reps") == 0)
      reps = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--rho") == 0)
      rho = std::atof(argv[i + 1]);
    else if (std::strcmp(argv[i], "--eager") == 0)
      eager = std::atoi(argv[i + 1]) != 0;
    else if (std::strcmp(argv[i], "--json") == 0)
      json_path = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gpu_decode_step: no CUDA device, nothing to measure\n");
    return 0;
  }
  if (layers < 1 || steps < 1 || reps < 1) {
    std::fprintf(stderr, "--layers, --steps and --reps must be >= 1\n");
    return 2;
  }
  cudaDeviceProp prop;
  DSA_BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; layers %d, r = 1, k = 1, rho %.2f; %d steps x %d reps\n",
              prop.name, prop.multiProcessorCount, layers, rho, steps, reps);
  std::string json = "{\"device\": \"" + std::string(prop.name) +
                     "\", \"layers\": " + std::to_string(layers) + ", \"rho\": " + JsonNumber(rho) +
                     ", \"steps\": " + std::to_string(steps) +
                     ", \"reps\": " + std::to_string(reps) + ", \"shapes\": [";
  bool failed = false;
  std::string summary;
  bool first_shape = true;
  for (const std::string& item : Split(shapes)) {
    const Shape shape = ParseShape(item);
    std::vector<ArmResult> results;
    int key_pools = 0, kv_pools = 0, splits = 0;
    int64_t weight_bytes = 0;
    double busy_us = 0;
    {
      StepModel model(shape.rows, shape.slots, layers, rho);
      key_pools = model.key_pools();
      kv_pools = model.kv_pools();
      splits = model.attention_splits();
      weight_bytes = model.standin_weight_bytes();
      busy_us = model.standin_busy_us();
      for (const ArmSpec& spec : kArms) results.push_back(model.Run(spec, steps, reps, eager));
    }
    std::printf(
        "\n== %s: index-key copies %d, KV copies %d, attention splits %d, stand-in %.1f MB "
        "+ %.0f us busy\n",
        item.c_str(), key_pools, kv_pools, splits, weight_bytes / 1e6, busy_us);
    std::printf("%-13s %12s %12s %12s %9s %9s %6s %8s\n", "arm", "graph_us/L", "eager_us/L",
                "step_ms", "sparsity", "sel_diff", "lse", "");
    json += std::string(first_shape ? "" : ", ") + "{\"shape\": \"" + item +
            "\", \"rows\": " + std::to_string(shape.rows) +
            ", \"slots\": " + std::to_string(shape.slots) +
            ", \"index_key_copies\": " + std::to_string(key_pools) +
            ", \"kv_copies\": " + std::to_string(kv_pools) +
            ", \"attention_splits\": " + std::to_string(splits) +
            ", \"standin_weight_bytes\": " + std::to_string(weight_bytes) +
            ", \"standin_busy_us\": " + JsonNumber(busy_us) + ", \"arms\": [";
    first_shape = false;
    for (size_t i = 0; i < results.size(); ++i) {
      const ArmResult& r = results[i];
      failed = failed || !r.lse_finite || r.selection_mismatches > 0;
      std::printf("%-13s %12.2f %12.2f %12.3f %9.3f %9d %6s\n", r.name.c_str(), r.graph_us / layers,
                  r.eager_us / layers, r.graph_us / 1e3, r.realized_sparsity,
                  r.selection_mismatches, r.lse_finite ? "ok" : "NaN");
      json += std::string(i ? ", " : "") + "{\"arm\": \"" + r.name +
              "\", \"graph_step_us\": " + JsonNumber(r.graph_us) +
              ", \"eager_step_us\": " + JsonNumber(r.eager_us) +
              ", \"graph_layer_us\": " + JsonNumber(r.graph_us / layers) +
              ", \"eager_layer_us\": " + JsonNumber(r.eager_us / layers) +
              ", \"realized_sparsity\": " + JsonNumber(r.realized_sparsity) +
              ", \"lse_finite\": " + (r.lse_finite ? "true" : "false") +
              ", \"selection_mismatched_layers\": " + std::to_string(r.selection_mismatches) +
              ", \"timeline_us\": [";
      for (size_t l = 0; l < r.timeline.size(); ++l) {
        json += l ? ", [" : "[";
        for (size_t k = 0; k < r.timeline[l].size(); ++k)
          json += (k ? ", " : "") + JsonNumber(r.timeline[l][k]);
        json += "]";
      }
      json += "]}";
    }
    json += "]}";
    // The derived figures, from the graph timings, per layer.
    const auto us = [&](const char* name) { return Find(results, name).graph_us / layers; };
    const double ceiling = us("ceiling"), serial_keep = us("serial_keep"),
                 serial_spin = us("serial_spin"), index_keep = us("indexer_keep"),
                 index_spin = us("indexer_spin");
    char line[512];
    std::snprintf(line, sizeof(line),
                  "\n%s: per layer ceiling %.1f us (attention %.1f + stand-in %.1f), indexer "
                  "keep %.1f / spin %.1f, serial keep %.1f / spin %.1f\n",
                  item.c_str(), ceiling, us("attention"), us("standin"), index_keep, index_spin,
                  serial_keep, serial_spin);
    summary += line;
    std::snprintf(line, sizeof(line), "%-12s %9s %9s %9s %9s %9s %9s\n", "arm", "layer_us", "/max",
                  "/sum", "hidden", "hid_spin", "gain");
    summary += line;
    for (const char* name : {"serial_keep", "serial_spin", "mli_keep_eq", "mli_keep_lo",
                             "spin_mli_eq", "spin_mli_lo", "mli_keep_late", "spin_mli_late"}) {
      const bool spin = std::strstr(name, "spin") != nullptr;
      const double index = spin ? index_spin : index_keep;
      const double step = us(name);
      std::snprintf(line, sizeof(line), "%-12s %9.1f %9.3f %9.3f %9.3f %9.3f %+8.1f%%\n", name,
                    step, step / std::max(ceiling, index), step / (ceiling + index),
                    (serial_keep - step) / (serial_keep - ceiling),
                    spin ? (serial_spin - step) / (serial_spin - ceiling) : NAN,
                    (serial_keep / step - 1) * 100);
      summary += line;
    }
  }
  json += "]}\n";
  std::printf("%s", summary.c_str());
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  if (failed) std::fprintf(stderr, "CHECK FAILED: non-finite LSE or mismatched selections\n");
  return failed ? 1 : 0;
}
