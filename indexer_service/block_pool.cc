// The block pool (see block_pool.h).
#include "indexer_service/block_pool.h"

#include <algorithm>
#include <functional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace dsa {

BlockPool::BlockPool(int64_t capacity_blocks, int head_dim)
    : head_dim_(head_dim),
      block_bytes_(static_cast<size_t>(kBlockSize) *
                   (static_cast<size_t>(head_dim) + sizeof(float))),
      storage_(block_bytes_ * static_cast<size_t>(capacity_blocks)),
      ref_counts_(capacity_blocks, 0) {
  free_list_.reserve(capacity_blocks);
  // Ascending ids form a valid min-heap under std::greater.
  for (int64_t b = 0; b < capacity_blocks; ++b) free_list_.push_back(static_cast<int32_t>(b));
}

absl::StatusOr<std::vector<int32_t>> BlockPool::Allocate(int64_t count) {
  if (count < 0) return absl::InvalidArgumentError("negative block count");
  if (count > free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("index-key cache full: need ", count,
                                                     " blocks, ", free_blocks(), " of ",
                                                     capacity_blocks(), " free"));
  }
  std::vector<int32_t> blocks(count);
  for (int64_t i = 0; i < count; ++i) {
    std::pop_heap(free_list_.begin(), free_list_.end(), std::greater<int32_t>());
    blocks[i] = free_list_.back();
    free_list_.pop_back();
    ref_counts_[blocks[i]] = 1;
  }
  return blocks;
}

void BlockPool::Retain(int32_t block_id) {
  DSA_CHECK(ref_counts_[block_id] > 0, "retain of a free block");
  if (++ref_counts_[block_id] == 2) ++shared_blocks_;
}

void BlockPool::Release(int32_t block_id) {
  DSA_CHECK(ref_counts_[block_id] > 0, "release of a free block");
  if (--ref_counts_[block_id] == 1) --shared_blocks_;
  if (ref_counts_[block_id] == 0) {
    free_list_.push_back(block_id);
    std::push_heap(free_list_.begin(), free_list_.end(), std::greater<int32_t>());
  }
}

}  // namespace dsa
