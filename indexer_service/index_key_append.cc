// One all-or-nothing append call (see index_key_append.h).
#include "indexer_service/index_key_append.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dsa {

absl::Status IndexKeyAppendCall::Append(uint64_t sequence_id, int layer, int64_t first_slot,
                                        std::span<const float> keys, int64_t num_keys,
                                        absl::string_view chunk_name) {
  DSA_ASSIGN_OR_RETURN(int64_t slots, indexer_->NumSlots(sequence_id, layer));
  if (first_slot != slots) {
    return absl::FailedPreconditionError(absl::StrCat(chunk_name, "first_slot ", first_slot,
                                                      " but layer ", layer, " of sequence ",
                                                      sequence_id, " holds ", slots, " slots"));
  }
  DSA_RETURN_IF_ERROR(indexer_->AppendIndexKeys(sequence_id, layer, keys, num_keys));
  bool seen = false;
  for (const Touched& t : touched_) {
    seen = seen || (t.sequence_id == sequence_id && t.layer == layer);
  }
  if (!seen) touched_.push_back({sequence_id, layer, slots});
  keys_appended_ += num_keys;
  return absl::OkStatus();
}

void IndexKeyAppendCall::Undo() {
  for (auto it = touched_.rbegin(); it != touched_.rend(); ++it) {
    (void)indexer_->TruncateIndexKeys(it->sequence_id, it->layer, it->original_slots);
  }
  touched_.clear();
  keys_appended_ = 0;
}

}  // namespace dsa
