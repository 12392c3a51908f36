// Conversion between dsa.common.v1.Tensor (bytes + dtype + shape, DESIGN.md section 5) and host
// arrays, with the validation every service applies to tensors it receives.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dsa/common/v1/tensor.pb.h"

namespace dsa {

/// Bytes of one element of `dtype`; 0 for DTYPE_UNSPECIFIED or an unknown value.
int DTypeBytes(dsa::common::v1::DType dtype);

/// Decodes a floating-point tensor (fp32, bf16 or fp8 e4m3fn) to fp32 values, row-major.
/// `expected_shape` lists the required extent of each dimension, -1 where any extent >= 0 is
/// accepted; the rank must match. `name` names the field in error messages.
/// Errors (INVALID_ARGUMENT): dtype unspecified, unknown or not floating point; rank or an extent
/// differs; a negative extent; the element count overflows; data.size() != elements x element size.
/// Values are not checked for finiteness (the engine does that where it matters).
absl::StatusOr<std::vector<float>> DecodeFloatTensor(const dsa::common::v1::Tensor& tensor,
                                                     std::span<const int64_t> expected_shape,
                                                     absl::string_view name);

/// Writes values (fp32 [product(shape)], row-major) as a DTYPE_FLOAT32 tensor of `shape`.
void EncodeFloatTensor(std::span<const float> values, std::span<const int64_t> shape,
                       dsa::common::v1::Tensor* tensor);

/// Writes values (int32 [product(shape)], row-major) as a DTYPE_INT32 tensor of `shape`.
void EncodeInt32Tensor(std::span<const int32_t> values, std::span<const int64_t> shape,
                       dsa::common::v1::Tensor* tensor);

/// Decodes a DTYPE_INT32 tensor of `expected_shape` (-1 = any extent). Errors as DecodeFloatTensor.
absl::StatusOr<std::vector<int32_t>> DecodeInt32Tensor(const dsa::common::v1::Tensor& tensor,
                                                       std::span<const int64_t> expected_shape,
                                                       absl::string_view name);

}  // namespace dsa
