// The .npy reader and writer of npy.h.
#include "common/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dsa {

absl::StatusOr<std::vector<int32_t>> ParseTokensNpy(absl::string_view data,
                                                    absl::string_view name) {
  if (data.size() < 10 || data.substr(0, 6) != "\x93NUMPY") {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a .npy file"));
  }
  const int major = static_cast<unsigned char>(data[6]);
  size_t header_bytes = 0, header_begin = 0;
  if (major == 1) {
    header_bytes = static_cast<unsigned char>(data[8]) | static_cast<unsigned char>(data[9]) << 8;
    header_begin = 10;
  } else if (major == 2 || major == 3) {
    if (data.size() < 12) return absl::DataLossError(absl::StrCat(name, ": truncated .npy header"));
    for (int i = 3; i >= 0; --i) {
      header_bytes = header_bytes << 8 | static_cast<unsigned char>(data[8 + i]);
    }
    header_begin = 12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": .npy format version ", major, " (1, 2 or 3 expected)"));
  }
  if (header_begin + header_bytes > data.size()) {
    return absl::DataLossError(absl::StrCat(name, ": truncated .npy header"));
  }
  const std::string header(data.substr(header_begin, header_bytes));
  if (header.find("'fortran_order': True") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": Fortran order is not supported"));
  }
  std::string descr;
  for (const char* candidate : {"<i4", "<u2", "<i8"}) {
    if (header.find(absl::StrCat("'descr': '", candidate, "'")) != std::string::npos) {
      descr = candidate;
    }
  }
  if (descr.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": token dtype must be uint16 (<u2), int32 (<i4) or int64 (<i8); header ", header));
  }
  const size_t element_bytes = descr == "<u2" ? 2 : descr == "<i4" ? 4 : 8;
  const size_t shape_begin = header.find("'shape': (");
  const size_t shape_end =
      shape_begin == std::string::npos ? std::string::npos : header.find(')', shape_begin);
  if (shape_end == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no shape in header ", header));
  }
  size_t count = 1;
  for (absl::string_view dim : absl::StrSplit(
           absl::string_view(header).substr(shape_begin + 10, shape_end - shape_begin - 10), ',',
           absl::SkipWhitespace())) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(dim, &value) || value < 0 || value > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": bad shape in header ", header));
    }
    // Bounded at every factor, so that a shape of many large dims cannot wrap around.
    if (value != 0 && count > (size_t{1} << 40) / static_cast<size_t>(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": the header's shape holds more than 2^40 tokens: ", header));
    }
    count *= static_cast<size_t>(value);
  }
  const size_t data_begin = header_begin + header_bytes;
  if (count > (size_t{1} << 40) || data.size() - data_begin != count * element_bytes) {
    return absl::DataLossError(absl::StrCat(name, ": ", data.size() - data_begin,
                                            " data bytes, expected ", count * element_bytes,
                                            " for the header's shape"));
  }
  std::vector<int32_t> tokens(count);
  for (size_t i = 0; i < count; ++i) {
    const char* p = data.data() + data_begin + i * element_bytes;
    int64_t value = 0;
    if (element_bytes == 2) {
      uint16_t v;
      std::memcpy(&v, p, 2);
      value = v;
    } else if (element_bytes == 4) {
      int32_t v;
      std::memcpy(&v, p, 4);
      value = v;
    } else {
      std::memcpy(&value, p, 8);
    }
    if (value < 0 || value > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": element ", i, " is ", value, ", not a token id in [0, 2^31)"));
    }
    tokens[i] = static_cast<int32_t>(value);
  }
  return tokens;
}

absl::StatusOr<std::vector<int32_t>> ReadTokensNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseTokensNpy(data, path);
}

absl::Status WriteNpy(const std::string& path, absl::string_view descr,
                      const std::vector<int64_t>& shape, const void* data, size_t bytes) {
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (",
                   absl::StrJoin(shape, ", "), shape.size() == 1 ? ",), }" : "), }");
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(magic, 8);
  const char length[2] = {static_cast<char>(header.size() & 0xff),
                          static_cast<char>(header.size() >> 8)};
  out.write(length, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace dsa
