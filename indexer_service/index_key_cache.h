// The paged index-key cache: per sequence and per full layer, a block table over the shared
// BlockPool, with fp8 quantization on append (DESIGN.md 4.1) and prefix sharing by reference count.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "indexer_service/block_pool.h"

namespace dsa {

/// A read-only view of one (sequence, layer) cache: logical block j of the sequence lives in pool
/// block `block_table[j]`; slots [0, num_slots) are filled. Valid until the cache is next modified.
struct KeyCacheView {
  const BlockPool* pool = nullptr;
  std::span<const int32_t> block_table;  // [ceil(num_slots / kBlockSize)] pool block ids
  int64_t num_slots = 0;
};

/// Usage counts of the pool, in blocks.
struct CacheUsage {
  int64_t capacity_blocks = 0;
  int64_t used_blocks = 0;    // allocated pool blocks (a shared block counts once)
  int64_t shared_blocks = 0;  // allocated blocks with more than one reference
  int64_t free_blocks = 0;
};

/// Not thread-safe: the owner (Indexer) serializes access. Sequence ids are caller-chosen uint64.
class IndexKeyCache {
 public:
  /// Most slots one (sequence, layer) holds: selections are int32 slot indices.
  static constexpr int64_t kMaxSlots = int64_t{1} << 31;

  /// capacity_blocks in [0, 2^31) and head_dim in [1, 1024], INVALID_ARGUMENT otherwise;
  /// RESOURCE_EXHAUSTED when the pool (allocated now) is larger than the machine's memory.
  static absl::StatusOr<IndexKeyCache> Create(int64_t capacity_blocks, int head_dim);

  int head_dim() const { return pool_.head_dim(); }
  /// The block pool (for a scoring device that mirrors it; see Indexer::Create).
  const BlockPool& pool() const { return pool_; }

  /// Registers an empty sequence with `num_layers` (>= 1) layer caches.
  /// ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT if num_layers < 1.
  absl::Status AddSequence(uint64_t sequence_id, int num_layers);

  /// Registers a sequence whose every layer starts with the first `num_prefix_slots` slots of
  /// `source_id`'s same layer, sharing those blocks (no copy). num_prefix_slots must be a multiple
  /// of kBlockSize and at most every source layer's length; the source must have `num_layers`
  /// layers. Errors: ALREADY_EXISTS, NOT_FOUND (source), INVALID_ARGUMENT (multiple, length, layer
  /// count).
  absl::Status AddSequenceWithPrefix(uint64_t sequence_id, int num_layers, uint64_t source_id,
                                     int64_t num_prefix_slots);

  /// Quantizes and appends `num_keys` index keys (fp32 [num_keys, head_dim], row-major) to layer
  /// `layer` of the sequence, at slots [num_slots, num_slots + num_keys). All or nothing: a shared
  /// partially filled last block is copied first (copy on write).
  /// Errors: NOT_FOUND (sequence), INVALID_ARGUMENT (layer out of range, keys.size() !=
  /// num_keys * head_dim, a non-finite value), RESOURCE_EXHAUSTED (not enough free blocks, or the
  /// layer would pass kMaxSlots).
  absl::Status Append(uint64_t sequence_id, int layer, std::span<const float> keys,
                      int64_t num_keys);

  /// Shortens layer `layer` to `num_slots` slots (dropping rejected speculative tokens), releasing
  /// blocks no longer needed. Errors: NOT_FOUND, INVALID_ARGUMENT (layer), OUT_OF_RANGE (num_slots
  /// < 0 or above the current length).
  absl::Status Truncate(uint64_t sequence_id, int layer, int64_t num_slots);

  /// Drops the sequence and its block references. NOT_FOUND if unknown.
  absl::Status RemoveSequence(uint64_t sequence_id);

  /// Errors: NOT_FOUND, INVALID_ARGUMENT (layer).
  absl::StatusOr<KeyCacheView> View(uint64_t sequence_id, int layer) const;
  /// Number of filled slots of (sequence, layer); same errors as View.
  absl::StatusOr<int64_t> NumSlots(uint64_t sequence_id, int layer) const;
  bool Contains(uint64_t sequence_id) const { return sequences_.contains(sequence_id); }
  /// Free blocks an Append of `num_keys` keys to (sequence, layer) would take (0 on bad ids).
  int64_t BlocksNeeded(uint64_t sequence_id, int layer, int64_t num_keys) const;

  CacheUsage Usage() const;

 private:
  struct LayerCache {
    std::vector<int32_t> block_table;
    int64_t num_slots = 0;
  };
  struct Sequence {
    std::vector<LayerCache> layers;
  };
  explicit IndexKeyCache(BlockPool pool) : pool_(std::move(pool)) {}
  absl::StatusOr<LayerCache*> FindLayer(uint64_t sequence_id, int layer);
  absl::StatusOr<const LayerCache*> FindLayer(uint64_t sequence_id, int layer) const;

  BlockPool pool_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
};

}  // namespace dsa
