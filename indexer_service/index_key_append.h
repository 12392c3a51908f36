// One all-or-nothing append call of index keys (prefill, restore) to an Indexer: the indexer side
// of AppendIndexKeys, shared by the gRPC service and the in-process indexer client.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "indexer_service/indexer.h"

namespace dsa {

/// Appends chunks in order and remembers every (sequence, layer) it touched with its slot count
/// before the call, so Undo() removes exactly what this call appended (Indexer::TruncateIndexKeys).
/// Not thread-safe; `indexer` must outlive it. The Indexer allows one append call per layer at a
/// time in effect: a concurrent append to the same layer sees its first_slot refused.
class IndexKeyAppendCall {
 public:
  explicit IndexKeyAppendCall(Indexer* indexer) : indexer_(indexer) {}

  /// Appends keys fp32 [num_keys, D] to (sequence_id, layer) at first_slot, which must equal the
  /// layer's slot count. Errors (nothing of this chunk appended): NOT_FOUND; FAILED_PRECONDITION
  /// (first_slot differs, verifier rows await Commit); Indexer::AppendIndexKeys's others. The
  /// message starts with `chunk_name` when given (e.g. "chunk 3: ").
  absl::Status Append(uint64_t sequence_id, int layer, int64_t first_slot,
                      std::span<const float> keys, int64_t num_keys,
                      absl::string_view chunk_name = {});

  /// Removes every key this call appended, newest layer first. Idempotent. A truncation can only
  /// fail when the sequence was released meanwhile, and then there is nothing left to undo.
  void Undo();

  int64_t keys_appended() const { return keys_appended_; }

 private:
  struct Touched {
    uint64_t sequence_id;
    int layer;
    int64_t original_slots;
  };
  Indexer* const indexer_;
  std::vector<Touched> touched_;  // first-touch order
  int64_t keys_appended_ = 0;
};

}  // namespace dsa
