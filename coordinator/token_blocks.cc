// Prefix block ids from token ids (see token_blocks.h).
#include "coordinator/token_blocks.h"

#include <array>

#include "common/check.h"
#include "coordinator/scheduler.h"
#include "openssl/evp.h"

namespace dsa {
namespace {

constexpr size_t kBlockTokens = static_cast<size_t>(kPrefixBlockTokens);

void PutLittleEndian(uint64_t value, int bytes, unsigned char* out) {
  for (int b = 0; b < bytes; ++b) out[b] = static_cast<unsigned char>(value >> (8 * b));
}

}  // namespace

std::vector<uint64_t> PrefixBlockIdsOfTokens(absl::Span<const int32_t> tokens) {
  const size_t blocks = tokens.size() / kBlockTokens;
  std::vector<uint64_t> ids;
  ids.reserve(blocks);
  std::array<unsigned char, 8 + 4 * kBlockTokens> message;
  uint64_t parent = 0;
  for (size_t j = 0; j < blocks; ++j) {
    PutLittleEndian(parent, 8, message.data());
    for (size_t t = 0; t < kBlockTokens; ++t) {
      PutLittleEndian(static_cast<uint32_t>(tokens[j * kBlockTokens + t]), 4,
                      message.data() + 8 + 4 * t);
    }
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int digest_size = 0;
    // EVP_Digest fails only when out of memory or with a broken OpenSSL: a true invariant.
    const int digested =
        EVP_Digest(message.data(), message.size(), digest, &digest_size, EVP_sha256(), nullptr);
    DSA_CHECK(digested == 1 && digest_size >= 8, "SHA-256 of a prefix block");
    uint64_t id = 0;
    for (int b = 0; b < 8; ++b) id |= static_cast<uint64_t>(digest[b]) << (8 * b);
    ids.push_back(id);
    parent = id;
  }
  return ids;
}

}  // namespace dsa
