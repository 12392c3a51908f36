// The block pool behind the paged index-key cache: fixed-size blocks of 64 slots laid out as
// DeepGEMM, vLLM and SGLang lay them out (DESIGN.md 4.1), shared by all sequences and layers, with
// reference counts so sequences with a common prefix can share blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "contracts/layout.h"

namespace dsa {

/// ceil(a / b) for a >= 0, b > 0: e.g. the blocks that hold a slots, CeilDiv(a, kBlockSize).
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// A pool of `capacity_blocks` blocks. Block layout (bytes): kBlockSize x head_dim fp8 e4m3 index
/// keys (slot-major), then kBlockSize fp32 scales: 132 bytes a slot at head_dim = 128.
/// Not thread-safe: the owner serializes access.
class BlockPool {
 public:
  /// capacity_blocks >= 0, head_dim >= 1 (checked by the owner; see IndexKeyCache::Create).
  BlockPool(int64_t capacity_blocks, int head_dim);

  int64_t capacity_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t used_blocks() const { return capacity_blocks() - free_blocks(); }
  int head_dim() const { return head_dim_; }
  /// Bytes of one block: kBlockSize * (head_dim + 4).
  size_t block_bytes() const { return block_bytes_; }

  /// Takes `count` free blocks with reference count 1, all or none (lowest ids first).
  /// RESOURCE_EXHAUSTED when fewer than `count` are free; nothing changes then.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count);
  /// Adds a reference to an allocated block (a second sequence shares it).
  void Retain(int32_t block_id);
  /// Drops a reference; the block returns to the free list at zero.
  void Release(int32_t block_id);
  int ref_count(int32_t block_id) const { return ref_counts_[block_id]; }
  /// Allocated blocks with more than one reference (kept as a count: O(1)).
  int64_t shared_blocks() const { return shared_blocks_; }

  /// fp8 e4m3 codes of block `block_id`: [kBlockSize, head_dim], slot-major.
  uint8_t* keys(int32_t block_id) { return storage_.data() + block_bytes_ * block_id; }
  const uint8_t* keys(int32_t block_id) const { return storage_.data() + block_bytes_ * block_id; }
  /// fp32 scales of block `block_id`: [kBlockSize].
  float* scales(int32_t block_id) {
    return reinterpret_cast<float*>(keys(block_id) + kBlockSize * head_dim_);
  }
  const float* scales(int32_t block_id) const {
    return reinterpret_cast<const float*>(keys(block_id) + kBlockSize * head_dim_);
  }

 private:
  int head_dim_;
  size_t block_bytes_;
  std::vector<uint8_t> storage_;
  std::vector<int32_t> ref_counts_;
  int64_t shared_blocks_ = 0;
  std::vector<int32_t> free_list_;  // a min-heap (std::greater): the lowest free id comes first
};

}  // namespace dsa
