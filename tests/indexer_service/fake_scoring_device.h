// A scoring device for tests without a GPU (indexer_service/scoring_device.h): it scores from its
// own mirror of the pool (so a block the Indexer forgets to mirror shows up as wrong scores) with
// the CPU reference, runs SPIN with SpinStates of its own, can be told to fail or decline, and with
// an ordinal >= 0 takes device-resident selects whose "device memory" is host memory.
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "indexer_service/scoring_device.h"
#include "indexer_service/topk.h"

namespace dsa::testing_fakes {

// The CPU reference's scores of `blocks` for `rows` (returned, ScoreBlocks' layout) and each row's
// top-K over them into selections [rows, top_k].
inline std::vector<float> ScoreAndSelectRows(const KeyCacheView& view,
                                             std::span<const int32_t> blocks,
                                             std::span<const IndexerRow> rows, int num_heads,
                                             int top_k, std::span<int32_t> selections) {
  std::vector<float> scores(rows.size() * blocks.size() * kBlockSize);
  ScoreBlocks(view, blocks, rows, num_heads, scores);
  const size_t stride = blocks.size() * kBlockSize;
  for (size_t r = 0; r < rows.size(); ++r) {
    SelectTopK(std::span<const float>(scores).subspan(r * stride, stride), blocks, rows[r].position,
               selections.subspan(r * top_k, top_k));
  }
  return scores;
}

// Knobs a test turns to make the fake misbehave; owned by the test (the Indexer owns the fake).
struct FakeControls {
  int mirror_calls = 0;
  int score_calls = 0;
  std::optional<int> fail_mirror_at;  // the n-th MirrorBlocks call (0-based) returns INTERNAL
  std::optional<int> fail_score_at;   // the n-th ScoreAndSelect call returns INTERNAL
  // Larger K: UNIMPLEMENTED, as a device with a smaller top-K would (RunWorkload's wide sequence
  // has K = kMaxTopK, which the engine allows and this fake declines).
  int max_top_k = kMaxTopK / 2;
  bool runs_spin = false;  // take SPIN too (RunsSpin for K <= max_top_k)
  int spin_calls = 0;
  std::optional<int> fail_spin_at;  // the n-th SelectWithSpin call returns INTERNAL
  // device_ordinal(): >= 0 makes the fake take device-resident selects, its "device memory"
  // being host memory (the events are never touched).
  int ordinal = -1;
  int enqueued_calls = 0;           // DeviceHandoff::on_enqueued calls
  bool fail_after_enqueue = false;  // with fail_spin_at: fail after on_enqueued, not before
};

class FakeDevice : public ScoringDevice {
 public:
  explicit FakeDevice(FakeControls* controls) : controls_(controls) {}

  std::string Describe() const override { return "fake"; }
  int device_ordinal() const override { return controls_->ordinal; }

  absl::Status Attach(const BlockPool& pool, int num_heads) override {
    host_ = &pool;
    mirror_.emplace(pool.capacity_blocks(), pool.head_dim());
    return absl::OkStatus();
  }

  absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override {
    if (controls_->fail_mirror_at == controls_->mirror_calls++) {
      return absl::InternalError("fake mirror failure");
    }
    for (int32_t id : block_ids) {
      std::memcpy(mirror_->keys(id), host_->keys(id), host_->block_bytes());
    }
    return absl::OkStatus();
  }

  absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    if (controls_->fail_score_at == controls_->score_calls++) {
      return absl::InternalError("fake scoring failure");
    }
    for (const DeviceScoreJob& job : jobs) {
      if (job.top_k > controls_->max_top_k) return absl::UnimplementedError("K too large");
    }
    for (const DeviceScoreJob& job : jobs) {
      KeyCacheView view = *job.view;
      view.pool = &*mirror_;  // score what was mirrored, not the host pool
      const std::vector<float> scores = ScoreAndSelectRows(view, job.logical_blocks, job.rows,
                                                           num_heads, job.top_k, job.selections);
      if (!job.scores.empty()) std::copy(scores.begin(), scores.end(), job.scores.begin());
    }
    seconds->scan = 1e-6;
    seconds->topk = 1e-6;
    return absl::OkStatus();
  }

  // SPIN "on the device": SpinStates of its own, fed only what the Indexer hands over.
  bool RunsSpin(const SpinConfig& config, int top_k) const override {
    return controls_->runs_spin && top_k <= controls_->max_top_k;
  }

  absl::Status SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    const bool fail = controls_->fail_spin_at == controls_->spin_calls++;
    if (fail && !controls_->fail_after_enqueue) return absl::InternalError("fake SPIN failure");
    const DeviceHandoff* handoff = jobs.empty() ? nullptr : jobs[0].handoff;
    for (const DeviceSpinJob& job_in : jobs) {
      // Device queries are host memory here: read them as host rows.
      DeviceSpinJob job = job_in;
      std::vector<IndexerRow> device_rows;
      if (job.handoff != nullptr) {
        const size_t values = static_cast<size_t>(num_heads) * host_->head_dim();
        for (IndexerRow row : job.rows) {
          if (row.device_query == nullptr || !row.query.empty()) {
            return absl::InternalError("a device-resident job's row without a device query");
          }
          row.query = std::span<const float>(row.device_query, values);
          device_rows.push_back(row);
        }
        job.rows = device_rows;
      }
      auto [it, fresh] =
          spin_.try_emplace({job.sequence_id, job.layer}, *job.config, job.top_k, job.layer);
      SpinSlot& slot = it->second;
      // As the CUDA device does: rho comes with every call (adaptive sparsity moves it).
      slot.spin.set_target_block_sparsity(job.config->target_block_sparsity);
      std::vector<int64_t> positions;
      for (const IndexerRow& row : job.rows) positions.push_back(row.position);
      slot.spin.TakeWarmup();  // the Indexer keeps the warm-up flag
      // kAllBlocks: every visible block, whatever the state would plan.
      std::vector<int32_t> blocks;
      if (job.all_blocks) {
        for (int64_t j = 0; j < CeilDiv(positions.back() + 1, kBlockSize); ++j) {
          blocks.push_back(static_cast<int32_t>(j));
        }
      } else {
        blocks = slot.spin.Plan(positions).blocks;
      }
      KeyCacheView view = *job.view;
      view.pool = &*mirror_;
      const std::vector<float> scores =
          ScoreAndSelectRows(view, blocks, job.rows, num_heads, job.top_k, job.selections);
      if (job.rows.size() == 1) {
        slot.spin.Update(positions[0], blocks, scores);
      } else {
        slot.pending_positions = positions;
        slot.pending_blocks = blocks;
        slot.pending_scores = scores;
      }
      if (job.scores != nullptr) *job.scores = scores;
      *job.blocks = std::move(blocks);
      if (job.handoff != nullptr) {
        std::copy(job.selections.begin(), job.selections.end(), job.device_selections);
      }
    }
    if (handoff != nullptr && handoff->on_enqueued) {
      ++controls_->enqueued_calls;
      handoff->on_enqueued();
    }
    if (fail) return absl::InternalError("fake SPIN failure after the hand-over");
    seconds->scan = 1e-6;
    return absl::OkStatus();
  }

  absl::Status CommitSpin(uint64_t sequence_id, int layer, int replay_rows) override {
    auto it = spin_.find({sequence_id, layer});
    if (it == spin_.end() || it->second.pending_positions.empty()) {
      return absl::FailedPreconditionError("nothing pending");
    }
    SpinSlot& slot = it->second;
    const size_t stride = slot.pending_blocks.size() * kBlockSize;
    for (int r = 0; r < replay_rows; ++r) {
      slot.spin.Update(slot.pending_positions[r], slot.pending_blocks,
                       std::span<const float>(slot.pending_scores).subspan(r * stride, stride));
    }
    slot.pending_positions.clear();
    return absl::OkStatus();
  }

  absl::Status ResetSpin(uint64_t sequence_id) override {
    for (auto& [key, slot] : spin_) {
      if (key.first == sequence_id) slot.spin.BeginTurn();
    }
    return absl::OkStatus();
  }

  void ReleaseSpin(uint64_t sequence_id) override {
    std::erase_if(spin_, [&](const auto& entry) { return entry.first.first == sequence_id; });
  }

  absl::Status ReadSpin(uint64_t sequence_id, int layer, std::vector<float>* vertical,
                        std::vector<float>* diagonal) override {
    auto it = spin_.find({sequence_id, layer});
    if (it == spin_.end()) return absl::NotFoundError("no SPIN state");
    *vertical = it->second.spin.vertical();
    *diagonal = it->second.spin.diagonal();
    return absl::OkStatus();
  }

 private:
  struct SpinSlot {
    SpinSlot(const SpinConfig& config, int top_k, int layer) : spin(config, top_k, layer) {}
    SpinState spin;
    std::vector<int64_t> pending_positions;
    std::vector<int32_t> pending_blocks;
    std::vector<float> pending_scores;
  };
  FakeControls* controls_;
  const BlockPool* host_ = nullptr;
  std::optional<BlockPool> mirror_;
  std::map<std::pair<uint64_t, int>, SpinSlot> spin_;
};

}  // namespace dsa::testing_fakes
