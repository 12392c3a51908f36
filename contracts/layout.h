// The layout constants every part agrees on (DESIGN.md 2 and 4.1): the paged cache's block, the
// prefix cache's block, and the MLA latent's dimensions. Plain constexpr ints, so that host code,
// CUDA kernels and tests share one name per constant.
#pragma once

namespace dsa {

/// Slots a block of the paged caches: the index-key cache's blocks, the KV cache's pages and the
/// unit of SPIN's block selection and of block sparsity (DESIGN.md 4.2). Every block-granular
/// length (a prefix share, a block count times slots) is a multiple of it.
inline constexpr int kBlockSize = 64;

/// Tokens a prefix-cache block hashes (the Mooncake traces' hash_ids cover this many tokens each;
/// the coordinator's prefix sharing and the pattern model's shared prefix use the same unit).
inline constexpr int kPrefixBlockTokens = 512;

/// MLA's latent (DeepSeek-V3.2; FlashMLA's layout): a cached KV slot is the compressed latent of
/// kMlaNopeDim values and kMlaRopeDim rotary dims, bf16. Keys are all kMlaKeyDim dims; values are
/// the first kMlaNopeDim.
inline constexpr int kMlaNopeDim = 512;
inline constexpr int kMlaRopeDim = 64;
inline constexpr int kMlaKeyDim = kMlaNopeDim + kMlaRopeDim;  // 576
inline constexpr int kMlaValueDim = kMlaNopeDim;              // 512

}  // namespace dsa
