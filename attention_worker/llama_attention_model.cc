// The real model behind the model seam (see llama_attention_model.h), and the CPU LlamaRunner
// (llama_runner.h) it uses by default: LlamaForward over LlamaKvCache, unchanged.
#include "attention_worker/llama_attention_model.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dsa {

namespace {

// ---- the CPU runner ----

class CpuLlamaRunner;

// Copies and truncations take the runner's lock, under which Begin marks caches in a pass, so that
// a CopyFrom on one thread cannot read a source that a pass on another thread is starting or
// writing; a pass ends (clears the mark) without the lock, and in_pass() reads it race-free.
class CpuLlamaCache : public LlamaSequenceCache {
 public:
  CpuLlamaCache(CpuLlamaRunner* runner, const LlamaModel& model) : runner_(runner), kv_(model) {}
  const LlamaRunner* runner() const override;
  int64_t num_slots() const override { return kv_.num_slots(); }
  absl::Status Truncate(int64_t num_slots) override;
  absl::Status CopyFrom(const LlamaSequenceCache& source) override;
  int64_t bytes() const override { return kv_.bytes(); }
  LlamaKvCache* kv() { return &kv_; }

 private:
  CpuLlamaRunner* const runner_;
  LlamaKvCache kv_;
};

class CpuLlamaPass : public LlamaPass {
 public:
  explicit CpuLlamaPass(std::unique_ptr<LlamaForward> forward) : forward_(std::move(forward)) {}
  int num_rows() const override { return forward_->num_rows(); }
  int next_layer() const override { return forward_->next_layer(); }
  bool done() const override { return forward_->done(); }
  absl::Status IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                             std::span<float> index_keys) override {
    return forward_->IndexerInputs(queries, head_weights, index_keys);
  }
  absl::Status RunLayer(std::span<const std::span<const int32_t>> selections) override {
    return forward_->RunLayer(selections);
  }
  absl::Status Logits(std::span<const int32_t> row_indices, std::span<float> out) override {
    return forward_->Logits(row_indices, out);
  }

 private:
  std::unique_ptr<LlamaForward> forward_;
};

class CpuLlamaRunner : public LlamaRunner {
 public:
  CpuLlamaRunner(std::shared_ptr<const LlamaModel> model, const LlamaForwardOptions& options)
      : model_(std::move(model)), options_(options) {}
  const LlamaModel& model() const override { return *model_; }
  std::string Description() const override { return "cpu"; }
  absl::StatusOr<std::unique_ptr<LlamaSequenceCache>> NewCache() override {
    return std::unique_ptr<LlamaSequenceCache>(new CpuLlamaCache(this, *model_));
  }
  absl::StatusOr<std::unique_ptr<LlamaPass>> Begin(std::vector<LlamaRunnerRow> rows) override {
    std::vector<LlamaRow> forward_rows(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r].cache != nullptr && rows[r].cache->runner() != this) {
        return absl::InvalidArgumentError(
            absl::StrCat("LlamaRunner::Begin: row ", r, "'s cache belongs to another runner"));
      }
      forward_rows[r] = LlamaRow{
          rows[r].cache == nullptr ? nullptr : static_cast<CpuLlamaCache*>(rows[r].cache)->kv(),
          rows[r].position, rows[r].token};
    }
    // Under the lock: CopyFrom, on another thread, checks and copies these caches under it.
    std::unique_lock<std::mutex> held(mutex_);
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaForward> forward,
                         LlamaForward::Begin(model_, std::move(forward_rows), options_));
    held.unlock();
    return std::unique_ptr<LlamaPass>(new CpuLlamaPass(std::move(forward)));
  }

  // Held by Begin while it marks caches in a pass, and by a cache's CopyFrom and Truncate.
  std::mutex& mutex() { return mutex_; }

 private:
  const std::shared_ptr<const LlamaModel> model_;
  const LlamaForwardOptions options_;
  std::mutex mutex_;
};

const LlamaRunner* CpuLlamaCache::runner() const { return runner_; }

absl::Status CpuLlamaCache::Truncate(int64_t num_slots) {
  std::lock_guard<std::mutex> held(runner_->mutex());
  return kv_.Truncate(num_slots);
}

absl::Status CpuLlamaCache::CopyFrom(const LlamaSequenceCache& source) {
  if (source.runner() != runner_ || &source == this) {
    return absl::InvalidArgumentError(
        "LlamaSequenceCache::CopyFrom: the source is this cache or another runner's");
  }
  const LlamaKvCache& from = static_cast<const CpuLlamaCache&>(source).kv_;
  // Under the lock: Begin, on another thread, marks the source in a pass under it. The whole copy
  // holds it (about 46 KB a slot at SmolLM2's shape), so other sequences' Begins wait that long;
  // prefix copies are rare next to steps.
  std::lock_guard<std::mutex> held(runner_->mutex());
  if (kv_.in_pass() || from.in_pass()) {
    return absl::FailedPreconditionError("LlamaSequenceCache::CopyFrom: a cache is in a pass");
  }
  return kv_.CopyFrom(from);
}

// ---- the engine's step ----

class LlamaModelStep : public ModelStep {
 public:
  LlamaModelStep(std::unique_ptr<LlamaPass> pass, std::vector<ModelRow> rows,
                 std::vector<SamplingParams> sampling, const LightningIndexerConfig& indexer,
                 int vocab_size, const LlamaAttentionModel::LogitsObserver* logits_observer)
      : logits_observer_(logits_observer),
        pass_(std::move(pass)),
        rows_(std::move(rows)),
        sampling_(std::move(sampling)),
        num_heads_(indexer.num_heads),
        head_dim_(indexer.head_dim),
        vocab_size_(vocab_size) {}

  absl::Status PrepareIndexerInputs(int model_layer, int full_rank) override {
    if (pass_->next_layer() != model_layer) {
      return absl::InvalidArgumentError(absl::StrCat("indexer inputs of layer ", model_layer,
                                                     " asked while layer ", pass_->next_layer(),
                                                     " is next"));
    }
    const size_t rows = rows_.size();
    queries_.resize(rows * num_heads_ * head_dim_);
    head_weights_.resize(rows * num_heads_);
    index_keys_.resize(rows * head_dim_);
    DSA_RETURN_IF_ERROR(pass_->IndexerInputs(queries_, head_weights_, index_keys_));
    prepared_rank_ = full_rank;
    return absl::OkStatus();
  }

  absl::Status IndexerInputs(int full_rank, int first_row, int num_rows,
                             std::span<const uint64_t> /*prefix_block_ids*/,
                             std::span<float> queries, std::span<float> head_weights,
                             std::span<float> index_keys) const override {
    if (full_rank != prepared_rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat("indexer inputs of full layer ", full_rank, " were not prepared"));
    }
    const auto h = static_cast<size_t>(num_heads_), d = static_cast<size_t>(head_dim_);
    if (first_row < 0 || num_rows < 1 || first_row + num_rows > static_cast<int>(rows_.size()) ||
        head_weights.size() != num_rows * h || index_keys.size() != num_rows * d ||
        (!queries.empty() && queries.size() != num_rows * h * d)) {
      return absl::InvalidArgumentError("indexer inputs: rows or span sizes out of range");
    }
    const auto first = static_cast<size_t>(first_row);
    if (!queries.empty()) {
      std::copy_n(queries_.begin() + first * h * d, num_rows * h * d, queries.begin());
    }
    std::copy_n(head_weights_.begin() + first * h, num_rows * h, head_weights.begin());
    std::copy_n(index_keys_.begin() + first * d, num_rows * d, index_keys.begin());
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                           std::span<float> /*outputs*/) override {
    if (pass_->next_layer() != model_layer) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", model_layer, " run while layer ",
                                                     pass_->next_layer(), " is next"));
    }
    if (rows.size() != rows_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(rows.size(), " attended rows for a step of ", rows_.size()));
    }
    std::vector<std::span<const int32_t>> selections(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r].device_selection != nullptr) {
        return absl::InvalidArgumentError("the real model takes host selections only");
      }
      selections[r] = rows[r].selection;
    }
    return pass_->RunLayer(selections);
  }

  absl::StatusOr<std::vector<int32_t>> Finish() override {
    const int vocab = vocab_size_;
    std::vector<int32_t> all(rows_.size());
    for (size_t r = 0; r < rows_.size(); ++r) all[r] = static_cast<int32_t>(r);
    std::vector<float> logits(rows_.size() * static_cast<size_t>(vocab));
    DSA_RETURN_IF_ERROR(pass_->Logits(all, logits));
    std::vector<int32_t> tokens(rows_.size());
    for (size_t r = 0; r < rows_.size(); ++r) {
      const std::span<const float> row(logits.data() + r * vocab, static_cast<size_t>(vocab));
      if (*logits_observer_) (*logits_observer_)(rows_[r].sequence_id, rows_[r].position, row);
      tokens[r] = SampleToken(row, sampling_[r], rows_[r].position + 1);
    }
    return tokens;
  }

 private:
  const LlamaAttentionModel::LogitsObserver* const logits_observer_;
  std::unique_ptr<LlamaPass> pass_;
  const std::vector<ModelRow> rows_;
  const std::vector<SamplingParams> sampling_;
  const int num_heads_;
  const int head_dim_;
  const int vocab_size_;
  int prepared_rank_ = -1;
  std::vector<float> queries_, head_weights_, index_keys_;
};

}  // namespace

std::shared_ptr<LlamaRunner> MakeCpuLlamaRunner(std::shared_ptr<const LlamaModel> model,
                                                const LlamaForwardOptions& options) {
  return std::make_shared<CpuLlamaRunner>(std::move(model), options);
}

absl::StatusOr<std::unique_ptr<LlamaAttentionModel>> LlamaAttentionModel::Create(
    std::shared_ptr<const LlamaModel> model, std::vector<int> full_layers, std::string name) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  return Create(MakeCpuLlamaRunner(std::move(model)), std::move(full_layers), std::move(name));
}

absl::StatusOr<std::unique_ptr<LlamaAttentionModel>> LlamaAttentionModel::Create(
    std::shared_ptr<LlamaRunner> runner, std::vector<int> full_layers, std::string name) {
  if (runner == nullptr) return absl::InvalidArgumentError("no model runner");
  const LlamaModel* model = &runner->model();
  if (!model->has_indexer()) {
    return absl::InvalidArgumentError(
        "the real model needs its lightning indexer weights (none were loaded)");
  }
  const int num_layers = model->config().num_layers;
  for (size_t i = 0; i < full_layers.size(); ++i) {
    if (full_layers[i] < 0 || full_layers[i] >= num_layers ||
        (i > 0 && full_layers[i] <= full_layers[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "full layer ", full_layers[i], " is not an increasing layer in [0, ", num_layers, ")"));
    }
  }
  return std::unique_ptr<LlamaAttentionModel>(
      new LlamaAttentionModel(std::move(runner), std::move(full_layers), std::move(name)));
}

LlamaAttentionModel::LlamaAttentionModel(std::shared_ptr<LlamaRunner> runner,
                                         std::vector<int> full_layers, std::string name)
    : runner_(std::move(runner)), model_(runner_->model()), full_layers_(std::move(full_layers)) {
  const LlamaConfig& config = model_.config();
  full_rank_.assign(config.num_layers, -1);
  for (size_t f = 0; f < full_layers_.size(); ++f) {
    full_rank_[full_layers_[f]] = static_cast<int>(f);
  }
  shape_.name = std::move(name);
  shape_.num_indexer_layers = config.num_layers;
  shape_.indexer_per_model_layer = true;
  shape_.num_heads = model_.indexer_config().num_heads;
  shape_.head_dim = model_.indexer_config().head_dim;
  shape_.vocab_size = config.vocab_size;
  shape_.eos_token_id = config.eos_token_id;
  shape_.max_context = config.context_length;
  shape_.full_layers = full_layers_;
}

std::shared_ptr<LlamaAttentionModel::Sequence> LlamaAttentionModel::Find(
    uint64_t sequence_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? nullptr : it->second;
}

absl::StatusOr<std::optional<int32_t>> LlamaAttentionModel::Extend(uint64_t sequence_id,
                                                                   int64_t first_slot,
                                                                   int64_t end_slot,
                                                                   std::span<const int32_t> tokens,
                                                                   const SamplingParams& sampling) {
  if (end_slot <= first_slot || static_cast<int64_t>(tokens.size()) != end_slot - first_slot) {
    return absl::InvalidArgumentError(absl::StrCat("extending slots [", first_slot, ", ", end_slot,
                                                   ") needs that many token ids, got ",
                                                   tokens.size()));
  }
  DSA_RETURN_IF_ERROR(ValidateSamplingParams(sampling));
  std::shared_ptr<Sequence> sequence = Find(sequence_id);
  const bool created = sequence == nullptr;
  if (created) {
    if (first_slot != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", sequence_id, " has no slots; cannot extend from ", first_slot));
    }
    sequence = std::make_shared<Sequence>();
    DSA_ASSIGN_OR_RETURN(sequence->kv, runner_->NewCache());
  } else if (sequence->kv->num_slots() != first_slot) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", sequence_id, " holds ",
                                                   sequence->kv->num_slots(),
                                                   " slots; cannot extend from ", first_slot));
  }
  std::vector<LlamaRunnerRow> rows(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    rows[i] = LlamaRunnerRow{sequence->kv.get(), first_slot + static_cast<int64_t>(i), tokens[i]};
  }
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaPass> pass, runner_->Begin(std::move(rows)));
  const int64_t n = end_slot - first_slot;
  const LightningIndexerConfig& indexer = model_.indexer_config();
  std::vector<std::vector<float>> index_keys(full_layers_.size());
  std::vector<float> queries(static_cast<size_t>(n) * indexer.num_heads * indexer.head_dim);
  std::vector<float> head_weights(static_cast<size_t>(n) * indexer.num_heads);
  for (int l = 0; l < model_.config().num_layers; ++l) {
    if (const int f = full_rank_[l]; f >= 0) {
      index_keys[f].resize(static_cast<size_t>(n) * indexer.head_dim);
      DSA_RETURN_IF_ERROR(pass->IndexerInputs(queries, head_weights, index_keys[f]));
    }
    DSA_RETURN_IF_ERROR(pass->RunLayer());
  }
  std::vector<float> logits(static_cast<size_t>(model_.config().vocab_size));
  const int32_t last_row = static_cast<int32_t>(n - 1);
  if (absl::Status s = pass->Logits(std::span<const int32_t>(&last_row, 1), logits); !s.ok()) {
    // The pass committed its rows when its last layer ran: back to where the sequence was.
    pass.reset();
    if (!created) (void)sequence->kv->Truncate(first_slot);
    return s;
  }
  pass.reset();
  if (logits_observer_) logits_observer_(sequence_id, end_slot - 1, logits);
  sequence->keys_first_slot = first_slot;
  sequence->index_keys = std::move(index_keys);
  if (created) {
    std::lock_guard<std::mutex> lock(mutex_);
    sequences_[sequence_id] = sequence;
  }
  return std::optional<int32_t>(SampleToken(logits, sampling, end_slot));
}

absl::Status LlamaAttentionModel::IndexKeys(uint64_t sequence_id,
                                            std::span<const uint64_t> /*prefix_block_ids*/,
                                            int full_rank, int64_t first_slot, int64_t num_slots,
                                            std::span<float> out) const {
  std::shared_ptr<Sequence> sequence = Find(sequence_id);
  const int64_t d = model_.indexer_config().head_dim;
  if (sequence == nullptr || full_rank < 0 ||
      full_rank >= static_cast<int>(sequence->index_keys.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("no index keys of sequence ", sequence_id, ", full layer ", full_rank));
  }
  const std::vector<float>& keys = sequence->index_keys[full_rank];
  const int64_t kept = static_cast<int64_t>(keys.size()) / d;
  const int64_t offset = first_slot - sequence->keys_first_slot;
  if (offset < 0 || num_slots < 0 || offset + num_slots > kept ||
      static_cast<int64_t>(out.size()) != num_slots * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("index keys of slots [", first_slot, ", ", first_slot + num_slots,
                     ") of sequence ", sequence_id, " were not computed (kept: [",
                     sequence->keys_first_slot, ", ", sequence->keys_first_slot + kept, "))"));
  }
  std::copy_n(keys.begin() + offset * d, num_slots * d, out.begin());
  return absl::OkStatus();
}

void LlamaAttentionModel::DropIndexKeys(uint64_t sequence_id) {
  if (std::shared_ptr<Sequence> sequence = Find(sequence_id)) {
    sequence->index_keys = {};
  }
}

absl::Status LlamaAttentionModel::Truncate(uint64_t sequence_id, int64_t num_slots) {
  std::shared_ptr<Sequence> sequence = Find(sequence_id);
  if (sequence == nullptr) return absl::OkStatus();
  if (num_slots == 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    sequences_.erase(sequence_id);
    return absl::OkStatus();
  }
  if (num_slots >= sequence->kv->num_slots()) return absl::OkStatus();
  return sequence->kv->Truncate(num_slots);
}

absl::StatusOr<std::unique_ptr<ModelStep>> LlamaAttentionModel::BeginStep(
    std::span<const ModelRow> rows) {
  std::vector<LlamaRunnerRow> llama_rows(rows.size());
  std::vector<SamplingParams> sampling(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    std::shared_ptr<Sequence> sequence = Find(rows[r].sequence_id);
    if (sequence == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", rows[r].sequence_id, " has no KV on this model"));
    }
    sampling[r] = rows[r].sampling;
    llama_rows[r] = LlamaRunnerRow{sequence->kv.get(), rows[r].position, rows[r].token};
  }
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaPass> pass, runner_->Begin(std::move(llama_rows)));
  return std::unique_ptr<ModelStep>(new LlamaModelStep(
      std::move(pass), std::vector<ModelRow>(rows.begin(), rows.end()), std::move(sampling),
      model_.indexer_config(), model_.config().vocab_size, &logits_observer_));
}

void LlamaAttentionModel::set_logits_observer(LogitsObserver observer) {
  logits_observer_ = std::move(observer);
}

}  // namespace dsa
