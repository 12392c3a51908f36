// The model the coordinator serves: what its attention workers run (their GetInfo), which decides
// whether requests carry token ids and what they are checked against.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace dsa {

/// The model the attention workers run (their GetInfo), as the coordinator serves it.
struct ServedModel {
  std::string name;           // "pattern", or the real model's name
  int32_t vocab_size = 0;     // token ids are in [0, vocab_size); 0: the pattern model
  int32_t eos_token_id = -1;  // -1: none (always, for the pattern model)
  int64_t max_context = 0;    // the most tokens a sequence may hold; 0: no limit
  /// A real model: token ids in, token ids out.
  bool real() const { return vocab_size > 0; }
  bool operator==(const ServedModel& other) const {
    return name == other.name && vocab_size == other.vocab_size &&
           eos_token_id == other.eos_token_id && max_context == other.max_context;
  }
  bool operator!=(const ServedModel& other) const { return !(*this == other); }
  /// "smollm2-135m (vocab 49152, eos 2, max_context 8192)", for messages.
  std::string ToString() const {
    return absl::StrCat(name, " (vocab ", vocab_size, ", eos ", eos_token_id, ", max_context ",
                        max_context, ")");
  }
};

}  // namespace dsa
