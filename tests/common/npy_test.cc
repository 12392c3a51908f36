// Tests of the .npy reader and writer (common/npy.h): the three token dtypes round trip through
// WriteNpy, numpy's own header of a uint16 file parses, and each malformed file is refused with
// its code.
#include "common/npy.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename T>
std::vector<int32_t> RoundTrip(const std::string& descr, const std::vector<T>& values,
                               const std::vector<int64_t>& shape) {
  const std::string path = TempPath("npy_test_" + descr.substr(1) + ".npy");
  EXPECT_TRUE(WriteNpy(path, descr, shape, values.data(), values.size() * sizeof(T)).ok());
  absl::StatusOr<std::vector<int32_t>> read = ReadTokensNpy(path);
  EXPECT_TRUE(read.ok()) << read.status();
  return read.ok() ? *read : std::vector<int32_t>();
}

TEST(Npy, TokenDtypesRoundTrip) {
  EXPECT_EQ(RoundTrip<uint16_t>("<u2", {0, 1, 49151, 65535}, {4}),
            (std::vector<int32_t>{0, 1, 49151, 65535}));
  EXPECT_EQ(RoundTrip<int32_t>("<i4", {7, 8, 9, 10, 11, 12}, {2, 3}),
            (std::vector<int32_t>{7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(RoundTrip<int64_t>("<i8", {5, 2147483647}, {2}), (std::vector<int32_t>{5, 2147483647}));
  EXPECT_TRUE(RoundTrip<uint16_t>("<u2", {}, {0}).empty());
}

TEST(Npy, WriterHeaderIsAlignedAsNumpyWritesIt) {
  const std::string path = TempPath("npy_test_align.npy");
  const std::vector<float> values = {1.5F, -2.0F};
  ASSERT_TRUE(WriteNpy(path, "<f4", {2}, values.data(), sizeof(float) * 2).ok());
  const std::string bytes = ReadAll(path);
  ASSERT_GE(bytes.size(), 10u);
  const size_t header = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9])
                                                                   << 8;
  EXPECT_EQ((10 + header) % 64, 0u);
  EXPECT_EQ(bytes[10 + header - 1], '\n');
  EXPECT_NE(bytes.find("'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"),
            std::string::npos);
  EXPECT_EQ(bytes.size(), 10 + header + 8);
}

// A numpy-written header, byte for byte (np.save of np.array([3, 4, 5], dtype=np.uint16)).
std::string NumpyUint16File() {
  std::string header = "{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');  // numpy aligns to 64 bytes
  header.push_back('\n');
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes.push_back(static_cast<char>(header.size()));
  bytes.push_back('\0');
  bytes += header;
  bytes += std::string("\x03\x00\x04\x00\x05\x00", 6);
  return bytes;
}

TEST(Npy, ParsesNumpysOwnHeader) {
  absl::StatusOr<std::vector<int32_t>> tokens = ParseTokensNpy(NumpyUint16File(), "mem");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(*tokens, (std::vector<int32_t>{3, 4, 5}));
}

TEST(Npy, RefusesMalformedFiles) {
  const std::string good = NumpyUint16File();
  EXPECT_EQ(ParseTokensNpy("not numpy at all", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Truncated data: the shape says 3 elements.
  EXPECT_EQ(ParseTokensNpy(good.substr(0, good.size() - 1), "f").status().code(),
            absl::StatusCode::kDataLoss);
  // Truncated header.
  EXPECT_EQ(ParseTokensNpy(good.substr(0, 30), "f").status().code(), absl::StatusCode::kDataLoss);
  std::string fortran = good;
  fortran.replace(fortran.find("False"), 5, "True ");
  EXPECT_EQ(ParseTokensNpy(fortran, "f").status().code(), absl::StatusCode::kInvalidArgument);
  std::string float_file = good;
  float_file.replace(float_file.find("<u2"), 3, "<f2");
  const absl::Status dtype = ParseTokensNpy(float_file, "tokens.npy").status();
  EXPECT_EQ(dtype.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dtype.message().find("tokens.npy: token dtype"), std::string::npos) << dtype;
  // A negative int32 is no token id.
  const std::string path = TempPath("npy_test_negative.npy");
  const std::vector<int32_t> negative = {1, -1};
  ASSERT_TRUE(WriteNpy(path, "<i4", {2}, negative.data(), 8).ok());
  EXPECT_EQ(ReadTokensNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTokensNpy(TempPath("npy_test_missing.npy")).status().code(),
            absl::StatusCode::kNotFound);
  // A shape whose product wraps around 2^64 (2^40 x 2^40 = 2^80) is no empty file.
  const std::string wrapped = TempPath("npy_test_wrapped.npy");
  ASSERT_TRUE(WriteNpy(wrapped, "<u2", {int64_t{1} << 40, int64_t{1} << 40}, nullptr, 0).ok());
  const absl::Status huge = ReadTokensNpy(wrapped).status();
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument) << huge;
  EXPECT_NE(huge.message().find("more than 2^40 tokens"), std::string::npos) << huge;
}

}  // namespace
}  // namespace dsa
