// The paged index-key cache (see index_key_cache.h).
#include "indexer_service/index_key_cache.h"

#include <unistd.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"

namespace dsa {
namespace {}  // namespace

absl::StatusOr<IndexKeyCache> IndexKeyCache::Create(int64_t capacity_blocks, int head_dim) {
  if (capacity_blocks < 0 || capacity_blocks > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_blocks must be in [0, 2^31), got ", capacity_blocks));
  }
  if (head_dim < 1 || head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be in [1, 1024], got ", head_dim));
  }
  // The pool is allocated up front: refuse what this machine's memory cannot hold.
  const double pool_bytes = static_cast<double>(capacity_blocks) * kBlockSize * (head_dim + 4.0);
  const double memory_bytes =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (memory_bytes > 0 && pool_bytes > memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("an index-key cache of ", capacity_blocks, " blocks needs ",
                     pool_bytes / (1 << 30), " GiB; this machine has ", memory_bytes / (1 << 30)));
  }
  return IndexKeyCache(BlockPool(capacity_blocks, head_dim));
}

absl::StatusOr<IndexKeyCache::LayerCache*> IndexKeyCache::FindLayer(uint64_t sequence_id,
                                                                    int layer) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  }
  if (layer < 0 || layer >= static_cast<int>(it->second.layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range [0, ",
                                                   it->second.layers.size(), ") for sequence ",
                                                   sequence_id));
  }
  return &it->second.layers[layer];
}

absl::StatusOr<const IndexKeyCache::LayerCache*> IndexKeyCache::FindLayer(uint64_t sequence_id,
                                                                          int layer) const {
  auto result = const_cast<IndexKeyCache*>(this)->FindLayer(sequence_id, layer);
  if (!result.ok()) return result.status();
  return *result;
}

absl::Status IndexKeyCache::AddSequence(uint64_t sequence_id, int num_layers) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be >= 1, got ", num_layers));
  }
  if (sequences_.contains(sequence_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", sequence_id, " already exists"));
  }
  sequences_[sequence_id].layers.resize(num_layers);
  return absl::OkStatus();
}

absl::Status IndexKeyCache::AddSequenceWithPrefix(uint64_t sequence_id, int num_layers,
                                                  uint64_t source_id, int64_t num_prefix_slots) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be >= 1, got ", num_layers));
  }
  if (sequences_.contains(sequence_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", sequence_id, " already exists"));
  }
  auto source = sequences_.find(source_id);
  if (source == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown prefix source sequence ", source_id));
  }
  if (static_cast<int>(source->second.layers.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("prefix source ", source_id, " has ",
                                                   source->second.layers.size(), " layers, not ",
                                                   num_layers));
  }
  if (num_prefix_slots < 0 || num_prefix_slots % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix length ", num_prefix_slots, " is not a non-negative multiple of ", kBlockSize));
  }
  for (const LayerCache& layer : source->second.layers) {
    if (layer.num_slots < num_prefix_slots) {
      return absl::InvalidArgumentError(absl::StrCat("prefix length ", num_prefix_slots,
                                                     " exceeds source length ", layer.num_slots));
    }
  }
  Sequence sequence;
  sequence.layers.resize(num_layers);
  const int64_t num_blocks = num_prefix_slots / kBlockSize;
  for (int l = 0; l < num_layers; ++l) {
    const LayerCache& from = source->second.layers[l];
    LayerCache& to = sequence.layers[l];
    to.block_table.assign(from.block_table.begin(), from.block_table.begin() + num_blocks);
    to.num_slots = num_prefix_slots;
    for (int32_t block : to.block_table) pool_.Retain(block);
  }
  sequences_.emplace(sequence_id, std::move(sequence));
  return absl::OkStatus();
}

int64_t IndexKeyCache::BlocksNeeded(uint64_t sequence_id, int layer, int64_t num_keys) const {
  auto found = FindLayer(sequence_id, layer);
  if (!found.ok() || num_keys <= 0) return 0;
  const LayerCache& cache = **found;
  int64_t needed = CeilDiv(cache.num_slots + num_keys, kBlockSize) -
                   static_cast<int64_t>(cache.block_table.size());
  const bool partial_last = cache.num_slots % kBlockSize != 0;
  if (partial_last && pool_.ref_count(cache.block_table.back()) > 1) ++needed;  // copy on write
  return needed;
}

absl::Status IndexKeyCache::Append(uint64_t sequence_id, int layer, std::span<const float> keys,
                                   int64_t num_keys) {
  auto found = FindLayer(sequence_id, layer);
  if (!found.ok()) return found.status();
  LayerCache& cache = **found;
  const int head_dim = pool_.head_dim();
  if (num_keys < 0 || keys.size() % head_dim != 0 ||
      keys.size() / head_dim != static_cast<size_t>(num_keys)) {
    return absl::InvalidArgumentError(absl::StrCat("index keys: got ", keys.size(),
                                                   " values, expected num_keys ", num_keys,
                                                   " x head_dim ", head_dim));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!std::isfinite(keys[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("index key ", i / head_dim, " dim ", i % head_dim, " is not finite"));
    }
  }
  if (num_keys == 0) return absl::OkStatus();
  // Selections are int32 slot indices: a layer holds at most 2^31 slots.
  if (num_keys > kMaxSlots - cache.num_slots) {
    return absl::ResourceExhaustedError(absl::StrCat("context too long: ", cache.num_slots, " + ",
                                                     num_keys, " slots exceeds ", kMaxSlots));
  }
  const int64_t needed = BlocksNeeded(sequence_id, layer, num_keys);
  auto allocated = pool_.Allocate(needed);
  if (!allocated.ok()) return allocated.status();
  size_t next = 0;
  // Copy on write of a shared, partially filled last block.
  if (cache.num_slots % kBlockSize != 0 && pool_.ref_count(cache.block_table.back()) > 1) {
    const int32_t copy = (*allocated)[next++];
    std::memcpy(pool_.keys(copy), pool_.keys(cache.block_table.back()), pool_.block_bytes());
    pool_.Release(cache.block_table.back());
    cache.block_table.back() = copy;
  }
  while (next < allocated->size()) cache.block_table.push_back((*allocated)[next++]);
  for (int64_t k = 0; k < num_keys; ++k) {
    const int64_t slot = cache.num_slots + k;
    const int32_t block = cache.block_table[slot / kBlockSize];
    const int64_t offset = slot % kBlockSize;
    pool_.scales(block)[offset] =
        QuantizeIndexKey(keys.subspan(k * head_dim, head_dim),
                         std::span<uint8_t>(pool_.keys(block) + offset * head_dim, head_dim));
  }
  cache.num_slots += num_keys;
  return absl::OkStatus();
}

absl::Status IndexKeyCache::Truncate(uint64_t sequence_id, int layer, int64_t num_slots) {
  auto found = FindLayer(sequence_id, layer);
  if (!found.ok()) return found.status();
  LayerCache& cache = **found;
  if (num_slots < 0 || num_slots > cache.num_slots) {
    return absl::OutOfRangeError(absl::StrCat("cannot truncate to ", num_slots, " slots; layer ",
                                              layer, " holds ", cache.num_slots));
  }
  const size_t keep_blocks = static_cast<size_t>(CeilDiv(num_slots, kBlockSize));
  while (cache.block_table.size() > keep_blocks) {
    pool_.Release(cache.block_table.back());
    cache.block_table.pop_back();
  }
  cache.num_slots = num_slots;
  return absl::OkStatus();
}

absl::Status IndexKeyCache::RemoveSequence(uint64_t sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  }
  for (const LayerCache& layer : it->second.layers) {
    for (int32_t block : layer.block_table) pool_.Release(block);
  }
  sequences_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<KeyCacheView> IndexKeyCache::View(uint64_t sequence_id, int layer) const {
  auto found = FindLayer(sequence_id, layer);
  if (!found.ok()) return found.status();
  return KeyCacheView{&pool_, (*found)->block_table, (*found)->num_slots};
}

absl::StatusOr<int64_t> IndexKeyCache::NumSlots(uint64_t sequence_id, int layer) const {
  auto found = FindLayer(sequence_id, layer);
  if (!found.ok()) return found.status();
  return (*found)->num_slots;
}

CacheUsage IndexKeyCache::Usage() const {
  CacheUsage usage;
  usage.capacity_blocks = pool_.capacity_blocks();
  usage.free_blocks = pool_.free_blocks();
  usage.used_blocks = pool_.used_blocks();
  usage.shared_blocks = pool_.shared_blocks();
  return usage;
}

}  // namespace dsa
