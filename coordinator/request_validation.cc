// The checks of a Generate request (see request_validation.h).
#include "coordinator/request_validation.h"

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "contracts/limits.h"
#include "coordinator/scheduler.h"

namespace dsa {
namespace {

// Slots a sequence may hold at most (an int32 position).
constexpr int64_t kMaxSlots = (int64_t{1} << 31) - 1;

// The first id of `ids` outside [0, limit) (limit 0: no upper bound), as "field[i] = v" with why.
std::optional<std::string> IdOutOfRange(const std::vector<int32_t>& ids, absl::string_view field,
                                        int64_t limit, absl::string_view model) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      return absl::StrCat(field, "[", i, "] = ", ids[i], ": token ids must be >= 0");
    }
    if (limit > 0 && ids[i] >= limit) {
      return absl::StrCat(field, "[", i, "] = ", ids[i], " is outside the vocabulary [0, ", limit,
                          ") of model '", model, "'");
    }
  }
  return std::nullopt;
}

}  // namespace

int64_t ContextLength(const GenerateSpec& request) {
  return request.context_tokens.has_value() ? static_cast<int64_t>(request.context_tokens->size())
                                            : request.context_length.value_or(0);
}

absl::Status ValidateGenerateRequest(const GenerateSpec& request) {
  if (request.request_id.empty() || request.request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id must be 1..", kMaxRequestIdBytes,
                                                   " bytes, got ", request.request_id.size()));
  }
  if (request.session_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session_id must be at most ",
                                                   kMaxRequestIdBytes, " bytes, got ",
                                                   request.session_id.size()));
  }
  int64_t context = 0;
  if (request.context_tokens.has_value()) {
    context = static_cast<int64_t>(request.context_tokens->size());
    if (context < 1) {
      return absl::InvalidArgumentError("context_tokens must hold at least one token");
    }
    if (auto bad = IdOutOfRange(*request.context_tokens, "context_tokens.tokens", 0, "");
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
    if (!request.prefix_block_ids.empty()) {
      return absl::InvalidArgumentError(
          "prefix_block_ids must be empty with context_tokens: the coordinator derives the prefix "
          "block ids from the tokens");
    }
  } else if (request.context_length.has_value()) {
    context = *request.context_length;
    if (context < 1) {
      return absl::InvalidArgumentError(absl::StrCat("context_length must be >= 1, got ", context));
    }
  } else {
    return absl::InvalidArgumentError("a context is required (context_length or context_tokens)");
  }
  if (request.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1, got ", request.max_new_tokens));
  }
  if (request.draft_length < 0 || request.draft_length > kMaxDraftLength) {
    return absl::InvalidArgumentError(absl::StrCat("draft_length must be in 0..", kMaxDraftLength,
                                                   ", got ", request.draft_length));
  }
  if (context > kMaxSlots || request.max_new_tokens > kMaxSlots ||
      context + request.max_new_tokens + request.draft_length > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("context (", context, ") + max_new_tokens (",
                                                   request.max_new_tokens,
                                                   ") + draft_length must stay below 2^31 slots"));
  }
  const int64_t max_prefix = (context + kPrefixBlockTokens - 1) / kPrefixBlockTokens;
  if (static_cast<int64_t>(request.prefix_block_ids.size()) > max_prefix) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_block_ids holds ", request.prefix_block_ids.size(), " ids; a context of ", context,
        " tokens allows at most ceil(", context, " / 512) = ", max_prefix));
  }
  const GenerateOverrides& o = request.overrides;
  if (o.target_block_sparsity.has_value() &&
      !(*o.target_block_sparsity >= 0.0 && *o.target_block_sparsity < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overrides.target_block_sparsity must be in [0, 1), got ", *o.target_block_sparsity));
  }
  if (o.exploration_fraction.has_value() &&
      !(*o.exploration_fraction >= 0.0 && *o.exploration_fraction < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overrides.exploration_fraction must be in [0, 1), got ", *o.exploration_fraction));
  }
  if (o.top_k.has_value() && (*o.top_k < 1 || *o.top_k > kMaxTopK)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.top_k must be in [1, ", kMaxTopK, "] (kMaxTopK), got ", *o.top_k));
  }
  if (o.acceptance_rate.has_value() && !(*o.acceptance_rate >= 0.0 && *o.acceptance_rate <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.acceptance_rate must be in [0, 1], got ", *o.acceptance_rate));
  }
  if (o.miss_target.has_value() && !(*o.miss_target >= 0.0 && *o.miss_target < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides.miss_target must be in [0, 1), got ", *o.miss_target));
  }
  const GenerateSampling& sampling = request.sampling;
  if (!(sampling.temperature == 0.0f ||
        (sampling.temperature > 0.0f && sampling.temperature <= 100.0f))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.temperature must be 0 (greedy) or in (0, 100], got ", sampling.temperature));
  }
  if (!(sampling.top_p >= 0.0f && sampling.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in (0, 1] (0 means 1), got ", sampling.top_p));
  }
  if (request.stop_token_ids.size() > static_cast<size_t>(kMaxStopTokenIds)) {
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids holds ",
                                                   request.stop_token_ids.size(), " ids; at most ",
                                                   kMaxStopTokenIds));
  }
  if (auto bad = IdOutOfRange(request.stop_token_ids, "stop_token_ids", 0, ""); bad.has_value()) {
    return absl::InvalidArgumentError(*bad);
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerateRequestForModel(const GenerateSpec& request,
                                             const ServedModel& model) {
  if (model.real()) {
    if (!request.context_tokens.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model '", model.name,
                       "' generates real tokens: the request needs context_tokens "
                       "(context_length alone is for the synthetic pattern model)"));
    }
    if (auto bad = IdOutOfRange(*request.context_tokens, "context_tokens.tokens", model.vocab_size,
                                model.name);
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
    if (auto bad =
            IdOutOfRange(request.stop_token_ids, "stop_token_ids", model.vocab_size, model.name);
        bad.has_value()) {
      return absl::InvalidArgumentError(*bad);
    }
  }
  const int64_t context = ContextLength(request);
  if (model.max_context > 0 && context + request.max_new_tokens > model.max_context) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "context (", context, " tokens) + max_new_tokens (", request.max_new_tokens,
        ") = ", context + request.max_new_tokens, " tokens exceed the max_context of model '",
        model.name, "' (", model.max_context, " tokens)"));
  }
  return absl::OkStatus();
}

}  // namespace dsa
