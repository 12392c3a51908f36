// N-gram prompt lookup drafts (see ngram_drafter.h).
#include "coordinator/ngram_drafter.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dsa {

absl::Status ValidateNgramDraftOptions(const NgramDraftOptions& options) {
  if (options.min_ngram < 1 || options.max_ngram < options.min_ngram ||
      options.max_ngram > kMaxNgram) {
    return absl::InvalidArgumentError(
        absl::StrCat("n-gram lengths must satisfy 1 <= min_ngram (--ngram-min, ", options.min_ngram,
                     ") <= max_ngram (--ngram-max, ", options.max_ngram, ") <= ", kMaxNgram));
  }
  return absl::OkStatus();
}

std::vector<int32_t> ProposeNgramDraft(absl::Span<const int32_t> tokens, int max_draft,
                                       const NgramDraftOptions& options) {
  const int64_t size = static_cast<int64_t>(tokens.size());
  if (max_draft <= 0) return {};
  for (int n = std::min<int64_t>(options.max_ngram, size - 1); n >= options.min_ngram; --n) {
    // The suffix tokens[size - n, size); an occurrence starting at `start` < size - n has at
    // least one token after it.
    const int32_t* suffix = tokens.data() + size - n;
    for (int64_t start = 0; start + n < size; ++start) {
      if (!std::equal(suffix, suffix + n, tokens.data() + start)) continue;
      const int64_t from = start + n;
      const int64_t count = std::min<int64_t>(max_draft, size - from);
      return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + from + count);
    }
  }
  return {};
}

}  // namespace dsa
