#include "tools/dsa/model_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "attention_worker/engine.h"
#include "attention_worker/llama_attention_model.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/llama_runner.h"
#include "common/mli_schedule.h"
#include "common/npy.h"
#include "common/status_macros.h"
#include "contracts/limits.h"
#include "coordinator/ngram_drafter.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/indexer.h"
#include "tools/dsa/replay.h"
#include "transport/in_process_indexer_client.h"

#ifdef DSA_WITH_CUDA
#include "attention_worker/cuda/llama_cuda_runner.h"
#endif

namespace dsa {
namespace {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// -log softmax(logits)[target], in double.
double NegativeLogLikelihood(std::span<const float> logits, int32_t target) {
  const float peak = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - peak);
  return std::log(sum) + peak - logits[target];
}

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Summed NLL and count of one kind of continuation.
struct NllSum {
  double nll = 0;
  int64_t tokens = 0;
  double Perplexity() const {
    return tokens == 0 ? 0 : std::exp(nll / static_cast<double>(tokens));
  }
};

// The mean and the nearest-rank `percentile` (NearestRankPercentile) of `values` (sorted in
// place, so the mean sums them in ascending order); zeros when empty.
struct Summary {
  double mean = 0;
  double quantile = 0;
};
Summary Summarize(std::vector<double>& values, double percentile) {
  if (values.empty()) return {};
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  return {sum / static_cast<double>(values.size()), NearestRankPercentile(values, percentile)};
}

// ---- dense: the runner's passes without selections (the reference every arm is read against) --

// Runs `contexts` densely on fresh caches, then `steps` single-row steps per sequence: each step
// feeds next_input(s, j) (the j-th token after the context) and hands the logits of position
// context + j - 1 .. to `on_logits(s, position, logits)`; the prefill's last logits too.
// next_input may read what on_logits stored (greedy generation).
template <typename NextInput, typename OnLogits>
absl::Status RunDense(LlamaRunner& runner, const std::vector<std::vector<int32_t>>& contexts,
                      int steps, NextInput next_input, OnLogits on_logits) {
  const int vocab = runner.model().config().vocab_size;
  std::vector<std::unique_ptr<LlamaSequenceCache>> caches;
  std::vector<float> logits(vocab);
  for (size_t s = 0; s < contexts.size(); ++s) {
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaSequenceCache> cache, runner.NewCache());
    std::vector<LlamaRunnerRow> rows;
    for (size_t t = 0; t < contexts[s].size(); ++t) {
      rows.push_back({cache.get(), static_cast<int64_t>(t), contexts[s][t]});
    }
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaPass> pass, runner.Begin(std::move(rows)));
    while (!pass->done()) DSA_RETURN_IF_ERROR(pass->RunLayer());
    const int32_t last = static_cast<int32_t>(contexts[s].size()) - 1;
    DSA_RETURN_IF_ERROR(pass->Logits(std::span<const int32_t>(&last, 1), logits));
    on_logits(s, static_cast<int64_t>(last), std::span<const float>(logits));
    caches.push_back(std::move(cache));
  }
  std::vector<float> step_logits(contexts.size() * vocab);
  std::vector<int32_t> all(contexts.size());
  for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int32_t>(s);
  for (int j = 0; j < steps; ++j) {
    std::vector<LlamaRunnerRow> rows;
    for (size_t s = 0; s < contexts.size(); ++s) {
      rows.push_back(
          {caches[s].get(), static_cast<int64_t>(contexts[s].size()) + j, next_input(s, j)});
    }
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaPass> pass, runner.Begin(std::move(rows)));
    while (!pass->done()) DSA_RETURN_IF_ERROR(pass->RunLayer());
    DSA_RETURN_IF_ERROR(pass->Logits(all, step_logits));
    for (size_t s = 0; s < contexts.size(); ++s) {
      on_logits(s, static_cast<int64_t>(contexts[s].size()) + j,
                std::span<const float>(step_logits).subspan(s * vocab, vocab));
    }
  }
  return absl::OkStatus();
}

// ---- attention-mass recall (LlamaForwardOptions::selection_mass_probe) ----

// What the CPU runner's probe reports while an arm runs: per (cache, layer, position) row, the sum
// over KV heads of their mean mass on the selection, and how many KV heads reported.
class MassSink {
 public:
  void Record(const void* cache, int layer, int64_t position, double mass) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!active_) return;
    auto& [sum, heads] = rows_[{cache, layer, position}];
    sum += mass;
    ++heads;
  }
  void Start() {
    std::lock_guard<std::mutex> lock(mutex_);
    rows_.clear();
    active_ = true;
  }
  // Per model layer, each row's mass recall (mean over its KV heads); stops recording.
  std::map<int, std::vector<double>> Stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    active_ = false;
    std::map<int, std::vector<double>> out;
    for (const auto& [key, value] : rows_) {
      out[std::get<1>(key)].push_back(value.first / value.second);
    }
    rows_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  bool active_ = false;
  std::map<std::tuple<const void*, int, int64_t>, std::pair<double, int>> rows_;
};

// ---- a sparse arm: the attention engine with an in-process indexer ----

struct ArmEngine {
  std::unique_ptr<Indexer> indexer;  // outlives the engine (declared first, destroyed last)
  std::unique_ptr<AttentionEngine> engine;
  std::vector<int> full_layers;  // the model layer of each full-layer rank
};

// Sequence ids are 1-based indices into the caller's arrays.
absl::StatusOr<ArmEngine> MakeArmEngine(std::shared_ptr<LlamaRunner> runner,
                                        const ModelEvalArm& arm, int64_t max_slots,
                                        int num_sequences,
                                        LlamaAttentionModel::LogitsObserver observer) {
  const LlamaModel& model = runner->model();
  const int num_layers = model.config().num_layers;
  DSA_ASSIGN_OR_RETURN(MliSchedule schedule,
                       MliSchedule::FromRetention(num_layers, arm.retention_stride, arm.lag_depth));
  DSA_ASSIGN_OR_RETURN(
      std::unique_ptr<LlamaAttentionModel> seam,
      LlamaAttentionModel::Create(std::move(runner), schedule.full_layers(), "smollm2-135m"));
  seam->set_logits_observer(std::move(observer));
  ArmEngine out;
  out.full_layers = schedule.full_layers();
  IndexerOptions indexer_options;
  const int64_t blocks_per_sequence = CeilDiv(max_slots, kBlockSize) + 1;
  indexer_options.capacity_blocks =
      blocks_per_sequence * num_sequences * static_cast<int64_t>(schedule.full_layers().size());
  indexer_options.num_heads = model.indexer_config().num_heads;
  indexer_options.head_dim = model.indexer_config().head_dim;
  // Every pruned select is scored densely as well: its miss rate against the dense top-K.
  indexer_options.audit_fraction = arm.spin ? 1.0 : 0.0;
  DSA_ASSIGN_OR_RETURN(out.indexer, Indexer::Create(indexer_options));
  AttentionEngineOptions options;
  options.kv_capacity_slots = (max_slots + kBlockSize) * num_sequences;
  DSA_ASSIGN_OR_RETURN(
      out.engine,
      AttentionEngine::Create(std::move(schedule), std::move(seam),
                              InProcessIndexerClient::Factory(out.indexer.get()), options));
  return out;
}

PrefillSpec ArmPrefill(const ModelEvalArm& arm, const ModelEvalOptions& options, uint64_t id,
                       std::vector<int32_t> tokens) {
  PrefillSpec spec;
  spec.sequence_id = id;
  spec.context_length = static_cast<int64_t>(tokens.size());
  spec.indexer_worker = kInProcessIndexerAddress;
  spec.top_k = options.top_k;
  spec.spin.enabled = arm.spin;
  spec.spin.target_block_sparsity = arm.target_block_sparsity;
  spec.spin.exploration_fraction = arm.exploration_fraction;
  spec.spin.seed = options.seed;
  if (arm.miss_target > 0) spec.spin.miss_target = arm.miss_target;
  if (arm.row0_policies) {
    spec.spin.spec_mask = SpecMaskPolicy::kRow0Sharing;
    spec.spin.spec_update = SpecUpdatePolicy::kRow0;
  }
  spec.tokens = std::move(tokens);
  return spec;
}

// The selection statistics of an arm's decode steps.
struct StepStats {
  int64_t blocks_scored = 0;
  int64_t blocks_visible = 0;
  std::vector<double> miss_rates;
  std::map<int, std::vector<double>> miss_by_full_rank;
  std::vector<int> full_layers;  // the arm's schedule: model layer of each full-layer rank
  // Per sequence id: blocks scored and visible, and its audited miss rates.
  std::map<uint64_t, std::pair<int64_t, int64_t>> blocks_by_sequence;
  std::map<uint64_t, std::vector<double>> miss_by_sequence;
  int64_t steps = 0;     // sequence-steps
  int64_t accepted = 0;  // draft tokens accepted over them
  void Add(const DecodeStepResult& step) {
    for (const SequenceStepResult& s : step.sequences) {
      blocks_scored += s.blocks_scored;
      blocks_visible += s.blocks_visible;
      blocks_by_sequence[s.sequence_id].first += s.blocks_scored;
      blocks_by_sequence[s.sequence_id].second += s.blocks_visible;
      for (const SequenceStepResult::AuditedRow& row : s.audited) {
        miss_rates.push_back(row.miss_rate);
        miss_by_full_rank[row.full_rank].push_back(row.miss_rate);
        miss_by_sequence[s.sequence_id].push_back(row.miss_rate);
      }
    }
  }
};

// Teacher-forces every sequence (context then continuation, `sequences[i]`, id i + 1) through the
// arm: a prefill of `context` tokens, then steps until every sequence has predicted its last
// token. A step feeds each sequence's next true token as row 0, and with draft_length > 0 up to d
// n-gram draft tokens as verifier rows; the drafts equal to the text (a prefix) are accepted and
// committed, and only the rows whose inputs were all true count (rows 0..a). Adds each sequence's
// NLL of tokens [context, context + continuation) to sums[kind[i]].
absl::Status ScoreArm(std::shared_ptr<LlamaRunner> runner, const ModelEvalArm& arm,
                      const ModelEvalOptions& options, int64_t context, int continuation,
                      const std::vector<std::vector<int32_t>>& sequences,
                      const std::vector<int>& kind, std::vector<NllSum>& sums, StepStats& stats) {
  std::mutex mutex;
  // (sequence index, position) -> the NLL of the token after `position`, until the step decides
  // whether that row's inputs were all true.
  std::map<std::pair<size_t, int64_t>, double> pending;
  const auto observer = [&](uint64_t id, int64_t position, std::span<const float> logits) {
    const std::vector<int32_t>& tokens = sequences[id - 1];
    if (position + 1 >= static_cast<int64_t>(tokens.size())) return;
    const double nll = NegativeLogLikelihood(logits, tokens[position + 1]);
    std::lock_guard<std::mutex> lock(mutex);
    pending[{id - 1, position}] = nll;
  };
  const auto settle = [&](size_t i, int64_t last_valid) {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = pending.lower_bound({i, 0}); it != pending.end() && it->first.first == i;) {
      if (it->first.second <= last_valid) {
        sums[kind[i]].nll += it->second;
        ++sums[kind[i]].tokens;
      }
      it = pending.erase(it);
    }
  };
  DSA_ASSIGN_OR_RETURN(ArmEngine arm_engine,
                       MakeArmEngine(std::move(runner), arm, context + continuation,
                                     static_cast<int>(sequences.size()), observer));
  stats.full_layers = arm_engine.full_layers;
  for (size_t i = 0; i < sequences.size(); ++i) {
    std::vector<int32_t> prompt(sequences[i].begin(), sequences[i].begin() + context);
    DSA_RETURN_IF_ERROR(
        arm_engine.engine->Prefill(ArmPrefill(arm, options, i + 1, std::move(prompt))).status());
    settle(i, context - 1);
  }
  // next[i]: the position of sequence i's next row 0 (its length); done at `end`, the position
  // after the last one whose prediction counts.
  const int64_t end = context + continuation - 1;
  std::vector<int64_t> next(sequences.size(), context);
  while (true) {
    std::vector<StepMember> members;
    std::vector<size_t> member_of;
    for (size_t i = 0; i < sequences.size(); ++i) {
      const int64_t t = next[i];
      if (t >= end) continue;
      StepMember member{i + 1, 1, {sequences[i][t]}};
      if (arm.draft_length > 0) {
        // Rows up to end - 1 only: a row's prediction past the window has no text to score.
        const int room = static_cast<int>(std::min<int64_t>(arm.draft_length, end - 1 - t));
        const std::vector<int32_t> draft = ProposeNgramDraft(
            absl::MakeConstSpan(sequences[i].data(), static_cast<size_t>(t + 1)), room);
        member.tokens.insert(member.tokens.end(), draft.begin(), draft.end());
        member.rows = static_cast<int>(member.tokens.size());
      }
      members.push_back(std::move(member));
      member_of.push_back(i);
    }
    if (members.empty()) break;
    DSA_ASSIGN_OR_RETURN(DecodeStepResult step, arm_engine.engine->DecodeStep(members));
    stats.Add(step);
    for (size_t m = 0; m < members.size(); ++m) {
      const size_t i = member_of[m];
      const int64_t t = next[i];
      int accepted = 0;
      while (accepted + 1 < members[m].rows &&
             members[m].tokens[accepted + 1] == sequences[i][t + accepted + 1]) {
        ++accepted;
      }
      if (members[m].rows > 1) {
        DSA_RETURN_IF_ERROR(arm_engine.engine->Commit(i + 1, accepted));
      }
      settle(i, t + accepted);
      next[i] = t + accepted + 1;
      ++stats.steps;
      stats.accepted += accepted;
    }
  }
  return absl::OkStatus();
}

struct NeedleCase {
  int64_t length = 0;
  double depth = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> answer;
};

absl::StatusOr<std::vector<NeedleCase>> ReadNeedles(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no needle cases at ", path));
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
    std::vector<NeedleCase> cases;
    for (const nlohmann::json& c : doc.at("cases")) {
      NeedleCase out;
      out.length = c.at("length").get<int64_t>();
      out.depth = c.at("depth").get<double>();
      out.tokens = c.at("tokens").get<std::vector<int32_t>>();
      out.answer = c.at("answer").get<std::vector<int32_t>>();
      if (static_cast<int64_t>(out.tokens.size()) != out.length || out.answer.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": a case of length ", out.length, " has ", out.tokens.size(),
                         " tokens and an answer of ", out.answer.size()));
      }
      cases.push_back(std::move(out));
    }
    return cases;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a needles file: ", e.what()));
  }
}

// Greedy answers of `cases` under the arm (or densely), as many tokens as each answer.
absl::StatusOr<std::vector<std::vector<int32_t>>> AnswerNeedles(
    std::shared_ptr<LlamaRunner> runner, const ModelEvalArm& arm, const ModelEvalOptions& options,
    const std::vector<const NeedleCase*>& cases) {
  size_t answer_tokens = 0;
  int64_t max_length = 0;
  for (const NeedleCase* c : cases) {
    answer_tokens = std::max(answer_tokens, c->answer.size());
    max_length = std::max(max_length, c->length);
  }
  std::vector<std::vector<int32_t>> generated(cases.size());
  const int steps = static_cast<int>(answer_tokens) - 1;
  if (arm.dense) {
    std::vector<std::vector<int32_t>> contexts;
    contexts.reserve(cases.size());
    for (const NeedleCase* c : cases) contexts.push_back(c->tokens);
    DSA_RETURN_IF_ERROR(RunDense(
        *runner, contexts, steps, [&](size_t s, int j) { return generated[s][j]; },
        [&](size_t s, int64_t, std::span<const float> logits) {
          generated[s].push_back(Argmax(logits));
        }));
    return generated;
  }
  DSA_ASSIGN_OR_RETURN(ArmEngine arm_engine,
                       MakeArmEngine(std::move(runner), arm, max_length + answer_tokens,
                                     static_cast<int>(cases.size()), nullptr));
  for (size_t i = 0; i < cases.size(); ++i) {
    SamplingParams greedy;
    PrefillSpec spec = ArmPrefill(arm, options, i + 1, cases[i]->tokens);
    spec.sampling = greedy;
    DSA_ASSIGN_OR_RETURN(PrefillResult prefill, arm_engine.engine->Prefill(spec));
    if (!prefill.next_token.has_value()) return absl::InternalError("no token from the prefill");
    generated[i].push_back(*prefill.next_token);
  }
  for (int j = 0; j < steps; ++j) {
    std::vector<StepMember> members;
    for (size_t i = 0; i < cases.size(); ++i) {
      members.push_back(StepMember{i + 1, 1, {generated[i].back()}});
    }
    DSA_ASSIGN_OR_RETURN(DecodeStepResult step, arm_engine.engine->DecodeStep(members));
    for (size_t i = 0; i < cases.size(); ++i) {
      generated[i].push_back(step.sequences[i].sampled_tokens.at(0));
    }
  }
  return generated;
}

absl::StatusOr<std::shared_ptr<LlamaRunner>> MakeRunner(std::shared_ptr<const LlamaModel> model,
                                                        const ModelEvalOptions& options,
                                                        const std::shared_ptr<MassSink>& sink) {
  LlamaForwardOptions cpu_options;
  cpu_options.selection_mass_probe = [sink](const LlamaKvCache* cache, int layer, int64_t position,
                                            int /*kv_head*/, double mass) {
    sink->Record(cache, layer, position, mass);
  };
  if (options.device == "cpu") return MakeCpuLlamaRunner(std::move(model), cpu_options);
#ifdef DSA_WITH_CUDA
  if (options.device == "cuda" || cuda::CudaDeviceCount() > 0) {
    return cuda::CreateCudaLlamaRunner(std::move(model), {options.cuda_device});
  }
#else
  if (options.device == "cuda") {
    return absl::FailedPreconditionError(
        "device cuda: this dsa was built without CUDA (configure with -DDSA_ENABLE_CUDA=ON)");
  }
#endif
  return MakeCpuLlamaRunner(std::move(model), cpu_options);
}

ModelEvalArm Arm(std::string name, int retention, int lag, bool spin, double rho, double gamma) {
  ModelEvalArm arm;
  arm.name = std::move(name);
  arm.retention_stride = retention;
  arm.lag_depth = lag;
  arm.spin = spin;
  arm.target_block_sparsity = rho;
  arm.exploration_fraction = gamma;
  return arm;
}

ModelEvalArm DenseArm() {
  ModelEvalArm arm;
  arm.name = "dense";
  arm.dense = true;
  return arm;
}

}  // namespace

std::vector<ModelEvalArm> DefaultModelEvalArms() {
  std::vector<ModelEvalArm> arms = {DenseArm(), Arm("all-keep", 1, 0, false, 0, 0)};
  for (double gamma : {0.0, 0.05}) {
    for (double rho : {0.2, 0.3, 0.4, 0.5}) {
      arms.push_back(
          Arm(absl::StrFormat("spin rho=%.1f gamma=%.2f", rho, gamma), 1, 0, true, rho, gamma));
    }
  }
  for (double target : {0.05, 0.2}) {
    ModelEvalArm adaptive =
        Arm(absl::StrFormat("spin adaptive miss<=%.2f", target), 1, 0, true, 0.4, 0.05);
    adaptive.miss_target = target;
    arms.push_back(adaptive);
  }
  arms.push_back(Arm("mli k=1", 1, 1, false, 0, 0));
  arms.push_back(Arm("mli k=2", 1, 2, false, 0, 0));
  arms.push_back(Arm("retention 1/2", 2, 0, false, 0, 0));
  arms.push_back(Arm("retention 1/4", 4, 0, false, 0, 0));
  arms.push_back(Arm("spin rho=0.4 gamma=0.05 + mli k=1 r=1/2", 2, 1, true, 0.4, 0.05));
  ModelEvalArm spec = Arm("spec d=3 all-keep", 1, 0, false, 0, 0);
  spec.draft_length = 3;
  arms.push_back(spec);
  spec = Arm("spec d=3 spin rho=0.4 union + prefix-valid", 1, 0, true, 0.4, 0);
  spec.draft_length = 3;
  arms.push_back(spec);
  spec.name = "spec d=3 spin rho=0.4 row-0 sharing + row-0 update";
  spec.row0_policies = true;
  arms.push_back(spec);
  return arms;
}

std::vector<ModelEvalArm> QuickModelEvalArms() {
  ModelEvalArm spec = Arm("spec d=3 spin rho=0.4 union + prefix-valid", 1, 0, true, 0.4, 0);
  spec.draft_length = 3;
  return {DenseArm(), Arm("all-keep", 1, 0, false, 0, 0),
          Arm("spin rho=0.4 gamma=0.05", 1, 0, true, 0.4, 0.05),
          Arm("mli k=1 r=1/2", 2, 1, false, 0, 0), spec};
}

absl::Status ValidateModelEvalOptions(const ModelEvalOptions& o) {
  const auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.contexts.empty()) return bad("no context lengths");
  for (int64_t c : o.contexts) {
    if (c < 64) return bad(absl::StrCat("context ", c, " is below 64 tokens"));
  }
  if (o.samples < 1) return bad(absl::StrCat("samples must be >= 1, got ", o.samples));
  if (o.continuation < 2) {
    return bad(absl::StrCat("continuation must be >= 2 tokens, got ", o.continuation));
  }
  if (o.top_k < 1 || o.top_k > kMaxTopK) {
    return bad(absl::StrCat("top_k must be in [1, ", kMaxTopK, "], got ", o.top_k));
  }
  if (o.arms.empty()) return bad("no arms");
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return bad(absl::StrCat("device \"", o.device, "\": auto, cpu or cuda"));
  }
  for (const ModelEvalArm& a : o.arms) {
    if (a.retention_stride < 1 || a.lag_depth < 0 || !(a.target_block_sparsity >= 0) ||
        a.target_block_sparsity >= 1 || !(a.exploration_fraction >= 0) ||
        a.exploration_fraction >= 1) {
      return bad(
          absl::StrCat("arm \"", a.name, "\": retention >= 1, lag >= 0, rho and gamma in [0, 1)"));
    }
    if (!(a.miss_target >= 0 && a.miss_target < 1) || (a.miss_target > 0 && !a.spin)) {
      return bad(absl::StrCat("arm \"", a.name, "\": a miss target in [0, 1) needs SPIN"));
    }
    if (a.draft_length < 0 || a.draft_length > kMaxDraftLength) {
      return bad(absl::StrCat("arm \"", a.name, "\": draft length ", a.draft_length,
                              " outside [0, ", kMaxDraftLength, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelEvalReport> RunModelEval(const ModelEvalOptions& options,
                                             void (*progress)(const std::string&),
                                             const ModelEvalCheckpoint& checkpoint) {
  DSA_RETURN_IF_ERROR(ValidateModelEvalOptions(options));
  const auto start = SteadyClock::now();
  // Everything a run could be refused for is checked before the first arm runs.
  std::vector<NeedleCase> cases;
  if (!options.needles_file.empty()) {
    DSA_ASSIGN_OR_RETURN(cases, ReadNeedles(options.needles_file));
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<const LlamaModel> model,
                       LlamaModel::Load(options.model_file, options.indexer_weights));
  DSA_ASSIGN_OR_RETURN(std::vector<int32_t> heldout, ReadTokensNpy(options.heldout_tokens));
  const int64_t max_context = model->config().context_length;
  for (const int64_t context : options.contexts) {
    if (context + options.continuation > max_context) {
      return absl::InvalidArgumentError(absl::StrCat("context ", context, " + continuation ",
                                                     options.continuation, " exceeds the model's ",
                                                     max_context));
    }
    if (heldout.size() < static_cast<size_t>(context + options.continuation)) {
      return absl::InvalidArgumentError(absl::StrCat(options.heldout_tokens, " holds ",
                                                     heldout.size(), " tokens, fewer than ",
                                                     context + options.continuation));
    }
  }
  std::map<int64_t, std::vector<const NeedleCase*>> needles_by_length;
  for (const NeedleCase& c : cases) {
    const bool wanted = options.needle_lengths.empty() ||
                        std::find(options.needle_lengths.begin(), options.needle_lengths.end(),
                                  c.length) != options.needle_lengths.end();
    if (!wanted) continue;
    if (c.length + static_cast<int64_t>(c.answer.size()) - 1 > max_context) {
      return absl::InvalidArgumentError(absl::StrCat(
          options.needles_file, ": a case of ", c.length, " tokens and a ", c.answer.size(),
          "-token answer exceeds the model's context of ", max_context));
    }
    needles_by_length[c.length].push_back(&c);
  }
  auto mass_sink = std::make_shared<MassSink>();
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<LlamaRunner> runner, MakeRunner(model, options, mass_sink));
  ModelEvalReport report;
  report.options = options;
  report.device = runner->Description();
  const auto say = [&](const std::string& line) {
    if (progress != nullptr) progress(line);
  };
  const auto save = [&] {
    report.seconds = SecondsSince(start);
    if (checkpoint) checkpoint(report);
  };

  for (const int64_t context : options.contexts) {
    const int m = options.continuation;
    const auto window = static_cast<size_t>(context + m);
    // The windows, spread evenly over the held-out tokens.
    std::vector<std::vector<int32_t>> real(options.samples);
    for (int i = 0; i < options.samples; ++i) {
      const size_t offset =
          (heldout.size() - window) * static_cast<size_t>(i) / static_cast<size_t>(options.samples);
      real[i].assign(heldout.begin() + offset, heldout.begin() + offset + window);
    }
    // Dense: the real continuations' NLL, and the greedy continuations (generated and scored).
    const auto dense_start = SteadyClock::now();
    std::vector<std::vector<int32_t>> contexts;
    contexts.reserve(real.size());
    for (const auto& r : real) contexts.emplace_back(r.begin(), r.begin() + context);
    NllSum dense_real;
    DSA_RETURN_IF_ERROR(RunDense(
        *runner, contexts, m - 1, [&](size_t s, int j) { return real[s][context + j]; },
        [&](size_t s, int64_t position, std::span<const float> logits) {
          dense_real.nll += NegativeLogLikelihood(logits, real[s][position + 1]);
          ++dense_real.tokens;
        }));
    std::vector<std::vector<int32_t>> greedy = contexts;
    NllSum dense_greedy;
    if (options.greedy_continuations) {
      DSA_RETURN_IF_ERROR(RunDense(
          *runner, contexts, m - 1, [&](size_t s, int j) { return greedy[s][context + j]; },
          [&](size_t s, int64_t, std::span<const float> logits) {
            const int32_t next = Argmax(logits);
            dense_greedy.nll += NegativeLogLikelihood(logits, next);
            ++dense_greedy.tokens;
            greedy[s].push_back(next);
          }));
    }
    for (const ModelEvalArm& arm : options.arms) {
      PerplexityCell cell;
      cell.arm = arm.name;
      cell.context = context;
      if (arm.dense) {
        cell.tokens_scored = dense_real.tokens;
        cell.real_perplexity = dense_real.Perplexity();
        cell.greedy_perplexity = dense_greedy.Perplexity();
        cell.seconds = SecondsSince(dense_start);
      } else {
        const auto arm_start = SteadyClock::now();
        std::vector<std::vector<int32_t>> sequences = real;
        std::vector<int> kind(real.size(), 0);
        if (options.greedy_continuations) {
          sequences.insert(sequences.end(), greedy.begin(), greedy.end());
          kind.resize(sequences.size(), 1);
        }
        std::vector<NllSum> sums(2);
        StepStats stats;
        mass_sink->Start();
        const absl::Status scored =
            ScoreArm(runner, arm, options, context, m, sequences, kind, sums, stats);
        std::map<int, std::vector<double>> mass = mass_sink->Stop();
        DSA_RETURN_IF_ERROR(scored);
        std::vector<double> all_mass;
        for (int l = 0; l < model->config().num_layers; ++l) {
          LayerSelectionStats layer;
          layer.model_layer = l;
          std::vector<double>& rows = mass[l];
          layer.rows = static_cast<int64_t>(rows.size());
          all_mass.insert(all_mass.end(), rows.begin(), rows.end());
          const Summary recall = Summarize(rows, 1);
          layer.mean_mass_recall = recall.mean;
          layer.p1_mass_recall = recall.quantile;
          const auto rank = std::find(stats.full_layers.begin(), stats.full_layers.end(), l);
          if (rank != stats.full_layers.end()) {
            std::vector<double>& misses =
                stats.miss_by_full_rank[static_cast<int>(rank - stats.full_layers.begin())];
            layer.audited_rows = static_cast<int64_t>(misses.size());
            const Summary miss = Summarize(misses, 99);
            layer.mean_miss_rate = miss.mean;
            layer.p99_miss_rate = miss.quantile;
          }
          cell.layers.push_back(layer);
        }
        const Summary recall = Summarize(all_mass, 1);
        cell.mean_mass_recall = recall.mean;
        cell.p1_mass_recall = recall.quantile;
        if (arm.spin) {
          for (const auto& [id, blocks] : stats.blocks_by_sequence) {
            SequenceSelectionStats seq;
            seq.window = static_cast<int>((id - 1) % real.size());
            seq.greedy = id > real.size();
            seq.realized_block_sparsity =
                blocks.second == 0
                    ? 0
                    : 1.0 - static_cast<double>(blocks.first) / static_cast<double>(blocks.second);
            std::vector<double>& misses = stats.miss_by_sequence[id];
            seq.audited_rows = static_cast<int64_t>(misses.size());
            const Summary miss = Summarize(misses, 99);
            seq.mean_miss_rate = miss.mean;
            seq.p99_miss_rate = miss.quantile;
            cell.sequences.push_back(seq);
          }
        }
        cell.tokens_scored = sums[0].tokens;
        cell.real_perplexity = sums[0].Perplexity();
        cell.greedy_perplexity = sums[1].Perplexity();
        cell.realized_block_sparsity = stats.blocks_visible == 0
                                           ? 0
                                           : 1.0 - static_cast<double>(stats.blocks_scored) /
                                                       static_cast<double>(stats.blocks_visible);
        cell.audited_rows = static_cast<int64_t>(stats.miss_rates.size());
        const Summary miss = Summarize(stats.miss_rates, 99);
        cell.mean_miss_rate = miss.mean;
        cell.p99_miss_rate = miss.quantile;
        cell.steps = stats.steps;
        cell.mean_accepted =
            stats.steps == 0 ? 0 : static_cast<double>(stats.accepted) / stats.steps;
        cell.seconds = SecondsSince(arm_start);
      }
      say(absl::StrFormat(
          "context %d %-40s ppl %.4f greedy %.4f mass %.3f sparsity %.3f miss %.3f/%.3f "
          "(%.1f s)",
          context, cell.arm, cell.real_perplexity, cell.greedy_perplexity, cell.mean_mass_recall,
          cell.realized_block_sparsity, cell.mean_miss_rate, cell.p99_miss_rate, cell.seconds));
      report.perplexity.push_back(std::move(cell));
      save();
    }
  }

  {
    for (const ModelEvalArm& arm : options.arms) {
      // A pass key is answered one row a step; a speculative arm would repeat its base arm.
      if (arm.draft_length > 0) continue;
      for (const auto& [length, group] : needles_by_length) {
        const auto arm_start = SteadyClock::now();
        DSA_ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> answers,
                             AnswerNeedles(runner, arm, options, group));
        int found = 0;
        for (size_t i = 0; i < group.size(); ++i) {
          NeedleCell cell;
          cell.arm = arm.name;
          cell.length = length;
          cell.depth = group[i]->depth;
          cell.generated = answers[i];
          cell.generated.resize(std::min(cell.generated.size(), group[i]->answer.size()));
          cell.found = cell.generated == group[i]->answer;
          found += cell.found ? 1 : 0;
          report.needles.push_back(std::move(cell));
        }
        say(absl::StrFormat("needles %d %-40s %d of %d (%.1f s)", length, arm.name, found,
                            group.size(), SecondsSince(arm_start)));
        save();
      }
    }
  }
  report.seconds = SecondsSince(start);
  report.complete = true;
  return report;
}

}  // namespace dsa
