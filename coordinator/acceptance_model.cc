// The seeded acceptance model (see acceptance_model.h).
#include "coordinator/acceptance_model.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "contracts/limits.h"

namespace dsa {

absl::StatusOr<AcceptanceModel> AcceptanceModel::Create(double acceptance_rate, int draft_length,
                                                        uint64_t seed) {
  if (!(acceptance_rate >= 0.0 && acceptance_rate <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("acceptance rate must be in [0, 1], got ", acceptance_rate));
  }
  if (draft_length < 0 || draft_length > kMaxDraftLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft length must be in [0, ", kMaxDraftLength, "], got ", draft_length));
  }
  return AcceptanceModel(acceptance_rate, draft_length, seed);
}

int AcceptanceModel::Accepted(uint64_t step) const {
  const PhiloxKey key{{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)}};
  const PhiloxCounter counter{
      {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0, 0}};
  const PhiloxCounter words = Philox4x32(counter, key);
  int accepted = 0;
  while (accepted < draft_length_ &&
         static_cast<double>(UniformFloat(words.c[accepted])) < acceptance_rate_) {
    ++accepted;
  }
  return accepted;
}

double AcceptanceModel::ExpectedAccepted() const {
  double sum = 0.0;
  for (int j = 1; j <= draft_length_; ++j) sum += std::pow(acceptance_rate_, j);
  return sum;
}

}  // namespace dsa
