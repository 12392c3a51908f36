// libFuzzer harness of the tensor codec (proto/tensor_codec.h): a dsa.common.v1.Tensor, mutated
// field by field (proto_mutator.h), decoded as every shape pattern the services use. Checks:
// never a crash or a sanitizer report; an accepted tensor has exactly product(shape) values of
// the expected rank; an fp32 tensor re-encodes to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dsa/common/v1/tensor.pb.h"
#include "fuzz/proto_mutator.h"
#include "proto/tensor_codec.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

int64_t Elements(const dsa::common::v1::Tensor& tensor) {
  int64_t n = 1;
  for (int64_t extent : tensor.shape()) n *= extent;
  return n;
}

}  // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  dsa::common::v1::Tensor scratch;
  return dsa::fuzz::MutateSerialized(scratch, data, size, max_size, seed);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsa::common::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  // The patterns of the services: queries [rows, H, D], weights [rows, H], keys [n, D],
  // selections [rows, K], and fully free ranks 1 and 2.
  const std::vector<std::vector<int64_t>> shapes = {{-1, 4, 8}, {-1, 4},  {-1, 8},
                                                    {-1},       {-1, -1}, {2, 4, 8}};
  for (const std::vector<int64_t>& shape : shapes) {
    auto floats = dsa::DecodeFloatTensor(tensor, shape, "fuzz");
    if (floats.ok()) {
      Check(tensor.shape_size() == static_cast<int>(shape.size()));
      Check(static_cast<int64_t>(floats->size()) == Elements(tensor));
      if (tensor.dtype() == dsa::common::v1::DTYPE_FLOAT32) {
        dsa::common::v1::Tensor again;
        dsa::EncodeFloatTensor(
            *floats, std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()), &again);
        Check(again.data() == tensor.data());
      }
    }
    auto ints = dsa::DecodeInt32Tensor(tensor, shape, "fuzz");
    if (ints.ok()) {
      Check(static_cast<int64_t>(ints->size()) == Elements(tensor));
      Check(ints->size() * 4 == tensor.data().size());
    }
  }
  return 0;
}
