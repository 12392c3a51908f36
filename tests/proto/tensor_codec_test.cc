// Tests of the wire tensor codec: decoded values by hand, and every malformed tensor refused.
#include "tensor_codec.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

using dsa::common::v1::Tensor;

Tensor Raw(dsa::common::v1::DType dtype, std::vector<int64_t> shape, std::string bytes) {
  Tensor t;
  t.set_dtype(dtype);
  for (int64_t e : shape) t.add_shape(e);
  t.set_data(bytes);
  return t;
}

TEST(TensorCodec, Float32RoundTrip) {
  const std::vector<float> values = {1.5f, -2.0f, 0.0f, 3.25f, 7.0f, -0.5f};
  const std::vector<int64_t> shape = {2, 3};
  Tensor t;
  EncodeFloatTensor(values, shape, &t);
  EXPECT_EQ(t.data().size(), 24u);
  const std::vector<int64_t> expected = {2, -1};
  auto decoded = DecodeFloatTensor(t, expected, "x");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, values);
}

TEST(TensorCodec, Bfloat16AndFp8DecodeByHand) {
  // bf16: 0x3f80 = 1.0, 0xc000 = -2.0, 0x4049 = 3.140625 (the top half of 3.140625f's bits).
  const uint16_t halves[3] = {0x3f80, 0xc000, 0x4049};
  std::string bytes(reinterpret_cast<const char*>(halves), sizeof(halves));
  const std::vector<int64_t> any = {-1};
  auto bf16 = DecodeFloatTensor(Raw(dsa::common::v1::DTYPE_BFLOAT16, {3}, bytes), any, "q");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(*bf16, (std::vector<float>{1.0f, -2.0f, 3.140625f}));
  // e4m3fn: 0x38 = 1.0, 0x7e = 448, 0xb0 = -0.5, 0x01 = 2^-9.
  const std::string codes = {'\x38', '\x7e', '\xb0', '\x01'};
  auto fp8 = DecodeFloatTensor(Raw(dsa::common::v1::DTYPE_FLOAT8_E4M3FN, {4}, codes), any, "q");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ(*fp8, (std::vector<float>{1.0f, 448.0f, -0.5f, 0.001953125f}));
}

TEST(TensorCodec, Int32RoundTrip) {
  const std::vector<int32_t> values = {5, -1, 7, 2048};
  const std::vector<int64_t> shape = {1, 4};
  Tensor t;
  EncodeInt32Tensor(values, shape, &t);
  auto decoded = DecodeInt32Tensor(t, shape, "selections");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, values);
}

TEST(TensorCodec, EmptyTensorsDecodeToNoValues) {
  // Found by fuzz_tensor_codec under UBSan: a [0, 4] tensor copied 0 bytes from a null pointer.
  for (const auto dtype : {common::v1::DTYPE_INT32, common::v1::DTYPE_FLOAT32}) {
    Tensor t;
    t.set_dtype(dtype);
    t.add_shape(0);
    t.add_shape(4);
    const std::vector<int64_t> shape = {-1, 4};
    if (dtype == common::v1::DTYPE_INT32) {
      auto decoded = DecodeInt32Tensor(t, shape, "selections");
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_TRUE(decoded->empty());
    } else {
      auto decoded = DecodeFloatTensor(t, shape, "keys");
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_TRUE(decoded->empty());
    }
  }
}

TEST(TensorCodec, MalformedTensorsAreInvalidArgument) {
  const std::vector<int64_t> two_by_any = {2, -1};
  const std::string eight_bytes(8, '\0');
  struct Case {
    const char* what;
    Tensor tensor;
  };
  const Case cases[] = {
      {"unspecified dtype", Raw(dsa::common::v1::DTYPE_UNSPECIFIED, {2, 1}, eight_bytes)},
      {"int32 where a float is needed", Raw(dsa::common::v1::DTYPE_INT32, {2, 1}, eight_bytes)},
      {"unknown dtype value", Raw(static_cast<dsa::common::v1::DType>(99), {2, 1}, eight_bytes)},
      {"rank 1", Raw(dsa::common::v1::DTYPE_FLOAT32, {2}, eight_bytes)},
      {"rank 3", Raw(dsa::common::v1::DTYPE_FLOAT32, {2, 1, 1}, eight_bytes)},
      {"first extent differs", Raw(dsa::common::v1::DTYPE_FLOAT32, {1, 2}, eight_bytes)},
      {"negative extent", Raw(dsa::common::v1::DTYPE_FLOAT32, {2, -1}, eight_bytes)},
      {"too few bytes", Raw(dsa::common::v1::DTYPE_FLOAT32, {2, 2}, eight_bytes)},
      {"too many bytes", Raw(dsa::common::v1::DTYPE_BFLOAT16, {2, 1}, eight_bytes)},
      {"element count overflows",
       Raw(dsa::common::v1::DTYPE_FLOAT32, {2, int64_t{1} << 62}, eight_bytes)},
  };
  for (const Case& c : cases) {
    auto decoded = DecodeFloatTensor(c.tensor, two_by_any, "keys");
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(decoded.status().message().find("keys"), absl::string_view::npos) << c.what;
  }
  EXPECT_EQ(DecodeInt32Tensor(Raw(dsa::common::v1::DTYPE_FLOAT32, {2, 1}, eight_bytes), two_by_any,
                              "selections")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A well-formed tensor with an empty dimension is fine: zero elements, zero bytes.
  auto empty = DecodeFloatTensor(Raw(dsa::common::v1::DTYPE_FLOAT32, {2, 0}, ""), two_by_any, "k");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->empty());
}

}  // namespace
}  // namespace dsa
