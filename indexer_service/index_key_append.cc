// One all-or-nothing append call (see index_key_append.h).
#include "indexer_service/index_key_append.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dsa {

absl::Status IndexKeyAppendCall::Append(uint64_t sequence_id, int layer, int64_t first_slot,
                                        std::span<const float> keys, int64_t num_keys,
                                        absl::string_view chunk_name) {
  // The slot count is checked and the keys appended under one lock (AppendIndexKeysAt), so two
  // calls appending to one layer cannot both pass the check.
  if (absl::Status appended =
          indexer_->AppendIndexKeysAt(sequence_id, layer, first_slot, keys, num_keys);
      !appended.ok()) {
    return absl::Status(appended.code(), absl::StrCat(chunk_name, appended.message()));
  }
  bool seen = false;
  for (const Touched& t : touched_) {
    seen = seen || (t.sequence_id == sequence_id && t.layer == layer);
  }
  if (!seen) touched_.push_back({sequence_id, layer, first_slot});  // what it held before
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
