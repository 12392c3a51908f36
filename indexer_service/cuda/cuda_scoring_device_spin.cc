// SPIN on the GPU for the CUDA scoring device (see cuda_scoring_device.h): V and D resident per
// (sequence, layer), and the whole select of select.h (scan, SPIN prediction, plan, top-K, union,
// EMA update) in one launch per run of jobs; the rest of the device is in cuda_scoring_device.cc.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "indexer_service/cuda/cuda_scoring_device_internal.h"
#include "indexer_service/cuda/query_stage.h"
#include "indexer_service/cuda/select.h"
#include "indexer_service/cuda/spin_update.h"

namespace dsa::cuda::scoring_internal {

absl::Status CudaScoringDevice::SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                                               DeviceScoreSeconds* seconds) {
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  // One launch per run of jobs sharing the launch-wide settings (layer, rho, gamma, a, K).
  auto same_launch = [](const DeviceSpinJob& a, const DeviceSpinJob& b) {
    return a.layer == b.layer && a.top_k == b.top_k &&
           a.config->target_block_sparsity == b.config->target_block_sparsity &&
           a.config->exploration_fraction == b.config->exploration_fraction &&
           a.config->ema_decay == b.config->ema_decay;
  };
  std::vector<bool> done(jobs.size(), false);
  std::vector<std::vector<const DeviceSpinJob*>> launches;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (done[i]) continue;
    std::vector<const DeviceSpinJob*> launch;
    for (size_t j = i; j < jobs.size(); ++j) {
      if (!done[j] && same_launch(jobs[i], jobs[j])) {
        launch.push_back(&jobs[j]);
        done[j] = true;
      }
    }
    launches.push_back(std::move(launch));
  }
  // The device-resident path: the producer's queries must be written before the first launch
  // stages them; the last launch records the handoff's event.
  const DeviceHandoff* handoff = jobs.empty() ? nullptr : jobs[0].handoff;
  if (handoff != nullptr && handoff->inputs_ready != nullptr) {
    DSA_CUDA_RETURN(
        cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(handoff->inputs_ready), 0),
        "waiting for the device queries");
  }
  double total_ms = 0;
  for (size_t i = 0; i < launches.size(); ++i) {
    float ms = 0;
    DSA_RETURN_IF_ERROR(
        SelectLaunch(launches[i], num_heads, &ms, i + 1 == launches.size() ? handoff : nullptr));
    total_ms += ms;
  }
  seconds->scan = total_ms * 1e-3;
  seconds->topk = 0;
  seconds->scan_kernel = last_scan_kernel_;
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::CommitSpin(uint64_t sequence_id, int layer, int replay_rows) {
  SpinSlot* found = FindSlot(sequence_id, layer);
  if (found == nullptr || found->pending_positions.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("no verifier step of sequence ", sequence_id,
                                                      " layer ", layer, " on the GPU"));
  }
  SpinSlot& slot = *found;
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  const int rows = std::min<int>(replay_rows, static_cast<int>(slot.pending_positions.size()));
  if (rows > 0) {
    // The replay's small arrays in one upload: first rows, block offsets, positions, score
    // offsets and the V / D pointers.
    size_t cursor = 0;
    const size_t at_first = Take(cursor, 2 * sizeof(int32_t));
    const size_t at_offset = Take(cursor, 2 * sizeof(int64_t));
    const size_t at_position = Take(cursor, rows * sizeof(int64_t));
    const size_t at_score = Take(cursor, rows * sizeof(int64_t));
    const size_t at_vertical = Take(cursor, sizeof(float*));
    const size_t at_diagonal = Take(cursor, sizeof(float*));
    DSA_RETURN_IF_ERROR(upload_.Reserve(cursor, "pinned upload buffer"));
    DSA_RETURN_IF_ERROR(batch_.Reserve(cursor, "device batch buffer"));
    upload_.as<int32_t>(at_first)[0] = 0;
    upload_.as<int32_t>(at_first)[1] = rows;
    upload_.as<int64_t>(at_offset)[0] = 0;
    upload_.as<int64_t>(at_offset)[1] = slot.pending_num_blocks;
    int64_t end_slot = 0;
    for (int r = 0; r < rows; ++r) {
      upload_.as<int64_t>(at_position)[r] = slot.pending_positions[r];
      upload_.as<int64_t>(at_score)[r] = r * slot.pending_num_blocks * kBlockSize;
      end_slot = std::max(end_slot, slot.pending_positions[r] + 1);
    }
    *upload_.as<float*>(at_vertical) = slot.vertical.as<float>();
    *upload_.as<float*>(at_diagonal) = slot.diagonal.as<float>();
    DSA_CUDA_RETURN(cudaMemcpyAsync(batch_.as<void>(), upload_.as<void>(), cursor,
                                    cudaMemcpyHostToDevice, stream_),
                    "uploading the replay");
    SpinUpdateParams update;
    update.num_groups = 1;
    update.num_rows = rows;
    update.group_first_row = batch_.as<int32_t>(at_first);
    update.group_block_offset = batch_.as<int64_t>(at_offset);
    update.logical_blocks = slot.pending_blocks.as<int32_t>();
    update.row_position = batch_.as<int64_t>(at_position);
    update.row_score_offset = batch_.as<int64_t>(at_score);
    update.scores = slot.pending_scores.as<float>();
    update.vertical = batch_.as<float* const>(at_vertical);
    update.diagonal = batch_.as<float* const>(at_diagonal);
    update.ema_decay = slot.ema_decay;
    update.max_visible_slots = end_slot;
    DSA_CUDA_RETURN(LaunchSpinUpdate(update, stream_), "launching the deferred update");
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "the deferred update");
    slot.used = std::max(slot.used, end_slot);
  }
  slot.pending_positions.clear();
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::ResetSpin(uint64_t sequence_id) {
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  auto layers = spin_.find(sequence_id);
  if (layers == spin_.end()) return absl::OkStatus();
  for (SpinSlot& slot : layers->second) {
    if (slot.capacity == 0) continue;
    DSA_CUDA_RETURN(
        cudaMemsetAsync(slot.vertical.as<void>(), 0, sizeof(float) * slot.capacity, stream_),
        "zeroing V");
    DSA_CUDA_RETURN(
        cudaMemsetAsync(slot.diagonal.as<void>(), 0, sizeof(float) * slot.capacity, stream_),
        "zeroing D");
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "zeroing the EMAs");
  return absl::OkStatus();
}

void CudaScoringDevice::ReleaseSpin(uint64_t sequence_id) {
  cudaSetDevice(options_.device);
  spin_.erase(sequence_id);
}

absl::Status CudaScoringDevice::ReadSpin(uint64_t sequence_id, int layer,
                                         std::vector<float>* vertical,
                                         std::vector<float>* diagonal) {
  const SpinSlot* found = FindSlot(sequence_id, layer);
  if (found == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("no SPIN state of sequence ", sequence_id, " layer ", layer, " on the GPU"));
  }
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  const SpinSlot& slot = *found;
  vertical->resize(slot.used);
  diagonal->resize(slot.used);
  if (slot.used > 0) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(vertical->data(), slot.vertical.as<void>(),
                                    sizeof(float) * slot.used, cudaMemcpyDeviceToHost, stream_),
                    "reading V");
    DSA_CUDA_RETURN(cudaMemcpyAsync(diagonal->data(), slot.diagonal.as<void>(),
                                    sizeof(float) * slot.used, cudaMemcpyDeviceToHost, stream_),
                    "reading D");
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "reading the EMAs");
  }
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::EnsureCapacity(SpinSlot& slot, int64_t slots) {
  if (slots <= slot.capacity) return absl::OkStatus();
  const int64_t capacity = std::max<int64_t>(slots, 2 * slot.capacity) + 1024;
  for (DeviceBuffer* buffer : {&slot.vertical, &slot.diagonal}) {
    DeviceBuffer grown;
    DSA_RETURN_IF_ERROR(grown.Reserve(sizeof(float) * capacity, "SPIN EMAs"));
    DSA_CUDA_RETURN(cudaMemsetAsync(grown.as<void>(), 0, sizeof(float) * capacity, stream_),
                    "zeroing the EMAs");
    if (slot.capacity > 0) {
      DSA_CUDA_RETURN(
          cudaMemcpyAsync(grown.as<void>(), buffer->as<void>(), sizeof(float) * slot.capacity,
                          cudaMemcpyDeviceToDevice, stream_),
          "copying the EMAs");
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "growing the EMAs");
    *buffer = std::move(grown);
  }
  slot.capacity = capacity;
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::SelectLaunch(const std::vector<const DeviceSpinJob*>& jobs,
                                             int num_heads, float* ms,
                                             const DeviceHandoff* notify) {
  const bool device_queries = jobs[0]->handoff != nullptr;
  const int num_groups = static_cast<int>(jobs.size());
  int64_t num_rows = 0, table_entries = 0, max_visible_blocks = 1;
  for (const DeviceSpinJob* job : jobs) {
    num_rows += static_cast<int64_t>(job->rows.size());
    table_entries += static_cast<int64_t>(job->view->block_table.size());
    const int64_t newest = job->rows.back().position;
    max_visible_blocks = std::max(max_visible_blocks, CeilDiv(newest + 1, kBlockSize));
    SpinSlot& slot = SlotFor(job->sequence_id, job->layer);
    slot.ema_decay = job->config->ema_decay;
    DSA_RETURN_IF_ERROR(EnsureCapacity(slot, newest + 1));
  }
  const char* why = "";
  bool tensor_cores = tensor_cores_;
  for (const DeviceSpinJob* job : jobs)
    tensor_cores = tensor_cores && QueriesFitBfloat16(job->rows);
  last_scan_kernel_ = tensor_cores ? "tensor-cores" : "cuda-cores";
  const size_t query_bytes = tensor_cores ? 2 : 4;
  const size_t query_values = static_cast<size_t>(num_heads) * head_dim_;
  // The upload.
  size_t cursor = 0;
  const size_t at_first_row = Take(cursor, sizeof(int32_t) * (num_groups + 1));
  const size_t at_table_offset = Take(cursor, sizeof(int64_t) * num_groups);
  const size_t at_tables = Take(cursor, sizeof(int32_t) * table_entries);
  const size_t at_num_slots = Take(cursor, sizeof(int64_t) * num_groups);
  const size_t at_query = Take(cursor, query_bytes * query_values * num_rows);
  const size_t at_weights = Take(cursor, sizeof(float) * num_heads * num_rows);
  const size_t at_position = Take(cursor, sizeof(int64_t) * num_rows);
  const size_t at_plan = Take(cursor, sizeof(SelectPlan) * num_groups);
  const size_t at_vertical = Take(cursor, sizeof(float*) * num_groups);
  const size_t at_diagonal = Take(cursor, sizeof(float*) * num_groups);
  const size_t at_capacity = Take(cursor, sizeof(int64_t) * num_groups);
  const size_t at_seed = Take(cursor, sizeof(uint64_t) * num_groups);
  const size_t at_query_pointers = Take(cursor, device_queries ? sizeof(float*) * num_rows : 0);
  const size_t upload_bytes = cursor;
  // The outputs, on the device after the upload.
  const size_t at_selection = Take(cursor, sizeof(int32_t) * num_rows * jobs[0]->top_k);
  const size_t at_block_offset = Take(cursor, sizeof(int64_t) * (num_groups + 1));
  const size_t at_score_offset = Take(cursor, sizeof(int64_t) * num_rows);
  const size_t at_blocks = Take(cursor, sizeof(int32_t) * num_groups * max_visible_blocks);
  const size_t download_bytes = cursor - at_selection;
  DSA_RETURN_IF_ERROR(upload_.Reserve(upload_bytes, "pinned upload buffer"));
  DSA_RETURN_IF_ERROR(download_.Reserve(download_bytes, "pinned download buffer"));
  DSA_RETURN_IF_ERROR(batch_.Reserve(cursor, "device batch buffer"));
  DSA_RETURN_IF_ERROR(scores_.Reserve(sizeof(float) * num_rows * max_visible_blocks * kBlockSize,
                                      "device score buffer"));
  int64_t row = 0, table = 0;
  for (int g = 0; g < num_groups; ++g) {
    const DeviceSpinJob& job = *jobs[g];
    SpinSlot& slot = *FindSlot(job.sequence_id, job.layer);
    upload_.as<int32_t>(at_first_row)[g] = static_cast<int32_t>(row);
    upload_.as<int64_t>(at_table_offset)[g] = table;
    std::memcpy(upload_.as<int32_t>(at_tables) + table, job.view->block_table.data(),
                sizeof(int32_t) * job.view->block_table.size());
    table += static_cast<int64_t>(job.view->block_table.size());
    upload_.as<int64_t>(at_num_slots)[g] = job.view->num_slots;
    upload_.as<SelectPlan>(at_plan)[g] =
        job.all_blocks ? SelectPlan::kAllBlocks : SelectPlan::kSpin;
    upload_.as<float*>(at_vertical)[g] = slot.vertical.as<float>();
    upload_.as<float*>(at_diagonal)[g] = slot.diagonal.as<float>();
    upload_.as<int64_t>(at_capacity)[g] = slot.capacity;
    upload_.as<uint64_t>(at_seed)[g] = job.config->seed;
    for (const IndexerRow& r : job.rows) {
      if (device_queries) {
        upload_.as<const float*>(at_query_pointers)[row] = r.device_query;
        std::memcpy(upload_.as<float>(at_weights) + row * num_heads, r.head_weights.data(),
                    sizeof(float) * num_heads);
      } else {
        WriteRow(r, row, tensor_cores, num_heads, at_query, at_weights);
      }
      upload_.as<int64_t>(at_position)[row] = r.position;
      ++row;
    }
  }
  upload_.as<int32_t>(at_first_row)[num_groups] = static_cast<int32_t>(row);

  SelectParams p;
  p.pool = device_pool_;
  p.head_dim = head_dim_;
  p.num_heads = num_heads;
  p.num_groups = num_groups;
  p.num_rows = static_cast<int>(num_rows);
  p.group_first_row = batch_.as<int32_t>(at_first_row);
  p.group_table_offset = batch_.as<int64_t>(at_table_offset);
  p.block_tables = batch_.as<int32_t>(at_tables);
  p.group_num_slots = batch_.as<int64_t>(at_num_slots);
  p.query = batch_.as<void>(at_query);
  p.query_dtype = tensor_cores ? QueryDtype::kBFloat16 : QueryDtype::kFloat32;
  p.head_weights = batch_.as<float>(at_weights);
  p.row_position = batch_.as<int64_t>(at_position);
  p.scan = tensor_cores ? SelectScan::kTensorCores : SelectScan::kCudaCores;
  p.group_plan = batch_.as<SelectPlan>(at_plan);
  p.vertical = batch_.as<float* const>(at_vertical);
  p.diagonal = batch_.as<float* const>(at_diagonal);
  p.spin_capacity = batch_.as<int64_t>(at_capacity);
  p.group_seed = batch_.as<uint64_t>(at_seed);
  const SpinConfig& config = *jobs[0]->config;
  p.top_k = jobs[0]->top_k;
  p.target_block_sparsity = config.target_block_sparsity;
  p.exploration_fraction = config.exploration_fraction;
  p.ema_decay = config.ema_decay;
  p.layer = jobs[0]->layer;
  p.update = true;
  p.max_visible_blocks = max_visible_blocks;
  p.host_all_blocks = std::all_of(jobs.begin(), jobs.end(),
                                  [](const DeviceSpinJob* job) { return job->all_blocks; });
  p.host_no_all_blocks = std::none_of(jobs.begin(), jobs.end(),
                                      [](const DeviceSpinJob* job) { return job->all_blocks; });
  p.selection = batch_.as<int32_t>(at_selection);
  p.scores = scores_.as<float>();
  p.row_score_offset = batch_.as<int64_t>(at_score_offset);
  p.group_blocks = batch_.as<int32_t>(at_blocks);
  p.group_block_offset = batch_.as<int64_t>(at_block_offset);
  p.workspace_bytes = SelectScratchBytes(p);
  DSA_RETURN_IF_ERROR(workspace_.Reserve(p.workspace_bytes, "select workspace"));
  p.workspace = workspace_.as<void>();
  if (!CanImplementSelect(p, &why)) {
    return absl::InternalError(absl::StrCat("the GPU select refused the batch: ", why));
  }
  DSA_CUDA_RETURN(cudaMemcpyAsync(batch_.as<void>(), upload_.as<void>(), upload_bytes,
                                  cudaMemcpyHostToDevice, stream_),
                  "uploading the batch");
  if (device_queries) {
    StageQueriesParams stage;
    stage.row_queries = batch_.as<const float* const>(at_query_pointers);
    stage.num_rows = num_rows;
    stage.values_per_row = static_cast<int64_t>(query_values);
    stage.to_bfloat16 = tensor_cores;
    stage.out = batch_.as<void>(at_query);
    DSA_CUDA_RETURN(LaunchStageQueries(stage, stream_), "staging the device queries");
  }
  DSA_CUDA_RETURN(cudaEventRecord(events_[0], stream_), "event");
  DSA_CUDA_RETURN(LaunchSelect(p, stream_), "launching the select");
  DSA_CUDA_RETURN(cudaEventRecord(events_[1], stream_), "event");
  if (device_queries) {
    // Each job's rows to its device_selections; runs of jobs whose outputs are adjacent (the
    // usual case: one buffer in batch order) in one copy.
    const int32_t* source = batch_.as<int32_t>(at_selection);
    const int64_t top_k = jobs[0]->top_k;
    int64_t first = 0;
    for (int g = 0; g < num_groups;) {
      int h = g;
      int64_t rows = static_cast<int64_t>(jobs[g]->rows.size());
      while (h + 1 < num_groups &&
             jobs[h + 1]->device_selections == jobs[g]->device_selections + rows * top_k) {
        ++h;
        rows += static_cast<int64_t>(jobs[h]->rows.size());
      }
      DSA_CUDA_RETURN(
          cudaMemcpyAsync(jobs[g]->device_selections, source + first * top_k,
                          sizeof(int32_t) * rows * top_k, cudaMemcpyDeviceToDevice, stream_),
          "handing over the selections");
      first += rows;
      g = h + 1;
    }
  }
  if (notify != nullptr) {
    if (notify->selections_ready != nullptr) {
      DSA_CUDA_RETURN(cudaEventRecord(static_cast<cudaEvent_t>(notify->selections_ready), stream_),
                      "recording the handoff's event");
    }
    if (notify->on_enqueued) notify->on_enqueued();
  }
  DSA_CUDA_RETURN(cudaMemcpyAsync(download_.as<void>(), batch_.as<uint8_t>() + at_selection,
                                  download_bytes, cudaMemcpyDeviceToHost, stream_),
                  "downloading the selections");
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "running the select");
  DSA_CUDA_RETURN(cudaEventElapsedTime(ms, events_[0], events_[1]), "event time");
  const auto* selection = download_.as<int32_t>();
  const auto* block_offset = download_.as<int64_t>(at_block_offset - at_selection);
  const auto* score_offset = download_.as<int64_t>(at_score_offset - at_selection);
  const auto* blocks = download_.as<int32_t>(at_blocks - at_selection);
  row = 0;
  for (int g = 0; g < num_groups; ++g) {
    const DeviceSpinJob& job = *jobs[g];
    SpinSlot& slot = *FindSlot(job.sequence_id, job.layer);
    const auto rows = static_cast<int64_t>(job.rows.size());
    const int64_t count = block_offset[g + 1] - block_offset[g];
    job.blocks->assign(blocks + block_offset[g], blocks + block_offset[g + 1]);
    std::memcpy(job.selections.data(), selection + row * job.top_k,
                sizeof(int32_t) * rows * job.top_k);
    const int64_t entries = rows * count * kBlockSize;
    const float* job_scores = scores_.as<float>() + score_offset[row];
    if (job.scores != nullptr) {
      job.scores->resize(entries);
      DSA_CUDA_RETURN(cudaMemcpyAsync(job.scores->data(), job_scores, sizeof(float) * entries,
                                      cudaMemcpyDeviceToHost, stream_),
                      "downloading the scores");
    }
    if (rows == 1) {
      slot.used = std::max(slot.used, job.rows[0].position + 1);
    } else {
      // The verifier step's scores and blocks stay on the GPU for CommitSpin.
      DSA_RETURN_IF_ERROR(slot.pending_scores.Reserve(sizeof(float) * entries, "pending scores"));
      DSA_RETURN_IF_ERROR(slot.pending_blocks.Reserve(sizeof(int32_t) * std::max<int64_t>(count, 1),
                                                      "pending blocks"));
      DSA_CUDA_RETURN(cudaMemcpyAsync(slot.pending_scores.as<void>(), job_scores,
                                      sizeof(float) * entries, cudaMemcpyDeviceToDevice, stream_),
                      "keeping the verifier scores");
      DSA_CUDA_RETURN(cudaMemcpyAsync(slot.pending_blocks.as<void>(),
                                      batch_.as<int32_t>(at_blocks) + block_offset[g],
                                      sizeof(int32_t) * count, cudaMemcpyDeviceToDevice, stream_),
                      "keeping the verifier blocks");
      slot.pending_num_blocks = count;
      slot.pending_positions.clear();
      for (const IndexerRow& r : job.rows) slot.pending_positions.push_back(r.position);
    }
    row += rows;
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "keeping the verifier step");
  return absl::OkStatus();
}

}  // namespace dsa::cuda::scoring_internal
