#include "common/instance_id.h"

#include <cstdint>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"

namespace dsa {

const std::string& ProcessInstanceId() {
  static const std::string* const id = [] {
    absl::BitGen gen;
    const uint64_t high = absl::Uniform<uint64_t>(gen);
    const uint64_t low = absl::Uniform<uint64_t>(gen);
    return new std::string(absl::StrFormat("%016x%016x", high, low));
  }();
  return *id;
}

}  // namespace dsa
