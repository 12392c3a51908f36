// Tensor codec (see tensor_codec.h). Host byte order must be little-endian (x86-64, aarch64).
#include "tensor_codec.h"

#include <bit>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fp8.h"

namespace dsa {
namespace {

using dsa::common::v1::DType;
using dsa::common::v1::Tensor;

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

// Validates dtype membership, shape against expected_shape and the byte length; returns the
// element count.
absl::StatusOr<int64_t> CheckTensor(const Tensor& tensor, std::span<const int64_t> expected_shape,
                                    absl::string_view name, std::span<const DType> accepted) {
  bool dtype_ok = false;
  for (DType d : accepted) dtype_ok |= tensor.dtype() == d;
  if (!dtype_ok) {
    std::vector<std::string> names;
    for (DType d : accepted) names.push_back(dsa::common::v1::DType_Name(d));
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": dtype ",
                     dsa::common::v1::DType_IsValid(tensor.dtype())
                         ? dsa::common::v1::DType_Name(tensor.dtype())
                         : absl::StrCat(static_cast<int>(tensor.dtype())),
                     " not accepted (", absl::StrJoin(names, ", "), ")"));
  }
  if (tensor.shape_size() != static_cast<int>(expected_shape.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank ", tensor.shape_size(), ", expected ", expected_shape.size()));
  }
  int64_t elements = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t extent = tensor.shape(i);
    if (extent < 0 || (expected_shape[i] >= 0 && extent != expected_shape[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": shape [", absl::StrJoin(tensor.shape(), ", "), "], expected [",
                       absl::StrJoin(expected_shape, ", "), "] (-1 = any)"));
    }
    if (extent != 0 && elements > std::numeric_limits<int64_t>::max() / 64 / extent) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": element count overflows"));
    }
    elements *= extent;
  }
  const int64_t bytes = elements * DTypeBytes(tensor.dtype());
  if (static_cast<int64_t>(tensor.data().size()) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", tensor.data().size(),
                                                   " bytes of data, shape and dtype need ", bytes));
  }
  return elements;
}

}  // namespace

int DTypeBytes(DType dtype) {
  switch (dtype) {
    case dsa::common::v1::DTYPE_FLOAT32:
    case dsa::common::v1::DTYPE_INT32:
      return 4;
    case dsa::common::v1::DTYPE_BFLOAT16:
      return 2;
    case dsa::common::v1::DTYPE_FLOAT8_E4M3FN:
      return 1;
    default:
      return 0;
  }
}

absl::StatusOr<std::vector<float>> DecodeFloatTensor(const Tensor& tensor,
                                                     std::span<const int64_t> expected_shape,
                                                     absl::string_view name) {
  static constexpr DType kAccepted[] = {dsa::common::v1::DTYPE_FLOAT32,
                                        dsa::common::v1::DTYPE_BFLOAT16,
                                        dsa::common::v1::DTYPE_FLOAT8_E4M3FN};
  auto elements = CheckTensor(tensor, expected_shape, name, kAccepted);
  if (!elements.ok()) return elements.status();
  std::vector<float> values(*elements);
  const auto* data = reinterpret_cast<const uint8_t*>(tensor.data().data());
  switch (tensor.dtype()) {
    case dsa::common::v1::DTYPE_FLOAT32:
      if (!values.empty()) std::memcpy(values.data(), data, values.size() * sizeof(float));
      break;
    case dsa::common::v1::DTYPE_BFLOAT16:
      for (size_t i = 0; i < values.size(); ++i) {
        uint16_t half;
        std::memcpy(&half, data + 2 * i, 2);
        values[i] = std::bit_cast<float>(static_cast<uint32_t>(half) << 16);
      }
      break;
    default: {  // fp8 e4m3fn
      const float* table = Fp8E4m3DecodeTable();
      for (size_t i = 0; i < values.size(); ++i) values[i] = table[data[i]];
    }
  }
  return values;
}

absl::StatusOr<std::vector<int32_t>> DecodeInt32Tensor(const Tensor& tensor,
                                                       std::span<const int64_t> expected_shape,
                                                       absl::string_view name) {
  static constexpr DType kAccepted[] = {dsa::common::v1::DTYPE_INT32};
  auto elements = CheckTensor(tensor, expected_shape, name, kAccepted);
  if (!elements.ok()) return elements.status();
  std::vector<int32_t> values(*elements);
  // An empty tensor has no buffer: memcpy's pointers must not be null even for 0 bytes (found by
  // fuzz_tensor_codec under UBSan).
  if (!values.empty()) {
    std::memcpy(values.data(), tensor.data().data(), values.size() * sizeof(int32_t));
  }
  return values;
}

void EncodeFloatTensor(std::span<const float> values, std::span<const int64_t> shape,
                       Tensor* tensor) {
  tensor->set_dtype(dsa::common::v1::DTYPE_FLOAT32);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  tensor->set_data(values.data(), values.size() * sizeof(float));
}

void EncodeInt32Tensor(std::span<const int32_t> values, std::span<const int64_t> shape,
                       Tensor* tensor) {
  tensor->set_dtype(dsa::common::v1::DTYPE_INT32);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  tensor->set_data(values.data(), values.size() * sizeof(int32_t));
}

}  // namespace dsa
