// The safetensors reader and writer of common/safetensors.h: mmap, header checks, the writer for
// tools and tests.
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace dsa {
namespace {

constexpr char kMetadataKey[] = "__metadata__";

absl::Status ErrnoStatus(int error_number, absl::string_view what, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(error_number),
                      absl::StrCat(path, ": ", what, ": ", std::strerror(error_number)));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// product(shape) * element_bytes, or -1 on overflow of int64.
int64_t TensorBytes(const std::vector<int64_t>& shape, int element_bytes) {
  int64_t total = element_bytes;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(total, dim, &total)) return -1;
  }
  return total;
}

// Parses one tensor entry of the header into `tensor` (offsets in `begin`, `end`).
absl::Status ParseTensorEntry(const std::string& path, const std::string& name,
                              const nlohmann::json& entry, SafetensorsTensor* tensor,
                              uint64_t* begin, uint64_t* end) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": safetensors header entry '", name, "' ", why));
  };
  if (!entry.is_object()) return bad("is not a JSON object");
  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) return bad("has no string \"dtype\"");
  tensor->dtype = dtype->get<std::string>();
  const int element_bytes = SafetensorsDtypeBytes(tensor->dtype);
  if (element_bytes == 0) return bad(absl::StrCat("has an unknown dtype \"", tensor->dtype, "\""));
  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) return bad("has no \"shape\" array");
  for (const nlohmann::json& dim : *shape) {
    if (!dim.is_number_unsigned()) return bad("has a shape entry that is not an integer >= 0");
    tensor->shape.push_back(static_cast<int64_t>(
        std::min<uint64_t>(dim.get<uint64_t>(), std::numeric_limits<int64_t>::max())));
  }
  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return bad("has no \"data_offsets\" [begin, end] of integers >= 0");
  }
  *begin = (*offsets)[0].get<uint64_t>();
  *end = (*offsets)[1].get<uint64_t>();
  if (*end < *begin) {
    return bad(absl::StrCat("has data_offsets [", *begin, ", ", *end, ") with end < begin"));
  }
  const int64_t expected = TensorBytes(tensor->shape, element_bytes);
  if (expected < 0 || static_cast<uint64_t>(expected) != *end - *begin) {
    return bad(absl::StrCat("spans ", *end - *begin, " bytes but ", tensor->dtype, " ",
                            ShapeString(tensor->shape), " needs ",
                            expected < 0 ? std::string("more than 2^63") : absl::StrCat(expected)));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsTensor::num_elements() const {
  int64_t total = 1;
  for (int64_t dim : shape) total *= dim;
  return total;
}

int SafetensorsDtypeBytes(std::string_view dtype) {
  static constexpr std::pair<std::string_view, int> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, bytes] : kSizes) {
    if (name == dtype) return bytes;
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open the safetensors file", path);
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error_number = errno;
    ::close(fd);
    return ErrnoStatus(error_number, "cannot stat", path);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const auto file_bytes = static_cast<uint64_t>(info.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: ", file_bytes,
                                            " bytes, expected at least 8 (the header length)"));
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (mapping == MAP_FAILED) return ErrnoStatus(map_errno, "cannot mmap", path);

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->file_bytes_ = file_bytes;
  file->mapping_ = mapping;
  const auto* base = static_cast<const std::byte*>(mapping);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<uint64_t>(base[i]);
  }
  if (header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": safetensors header length ",
                                                   header_bytes, " is above the limit of ",
                                                   kMaxHeaderBytes,
                                                   " bytes (not a safetensors "
                                                   "file?)"));
  }
  if (header_bytes > file_bytes - 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: ", file_bytes,
                                            " bytes, expected at least ", 8 + header_bytes,
                                            " (the header alone)"));
  }
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  const nlohmann::json header = nlohmann::json::parse(header_begin, header_begin + header_bytes,
                                                      nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the safetensors header (", header_bytes,
                     " bytes after the length) is not a JSON object"));
  }

  // Parse every entry; then check the offsets as a whole.
  struct Extent {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": safetensors \"__metadata__\" is not a JSON object"));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": safetensors metadata '", key,
                                                         "' is not a string (the format's rule)"));
        }
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    SafetensorsTensor tensor;
    uint64_t begin = 0, end = 0;
    const absl::Status parsed = ParseTensorEntry(path, name, entry, &tensor, &begin, &end);
    if (!parsed.ok()) return parsed;
    auto [it, inserted] = file->tensors_.emplace(name, std::move(tensor));
    extents.push_back({begin, end, &it->first});
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;  // the data section is covered up to here
  for (const Extent& extent : extents) {
    if (extent.begin != covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": safetensors tensor '", *extent.name, "' starts at data offset ", extent.begin,
          " but the tensors before it end at ", covered,
          extent.begin < covered ? " (overlap)" : " (a hole; the format forbids both)"));
    }
    covered = extent.end;
  }
  const uint64_t expected_bytes = 8 + header_bytes + covered;
  if (file_bytes < expected_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: ", file_bytes,
                                            " bytes, expected ", expected_bytes, " (8 + header ",
                                            header_bytes, " + data ", covered, ")"));
  }
  if (file_bytes > expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": safetensors file has ", file_bytes - expected_bytes,
        " bytes after its data section: ", file_bytes, " bytes, expected ", expected_bytes));
  }
  const std::byte* data = base + 8 + header_bytes;
  for (const Extent& extent : extents) {
    SafetensorsTensor& tensor = file->tensors_.find(*extent.name)->second;
    tensor.bytes = std::span<const std::byte>(data + extent.begin, extent.end - extent.begin);
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, file_bytes_);
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  const auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::map<std::string, std::string>& metadata,
                              std::span<const SafetensorsTensorToWrite> tensors) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) {
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const SafetensorsTensorToWrite& tensor : tensors) {
    const int element_bytes = SafetensorsDtypeBytes(tensor.dtype);
    if (element_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", tensor.name, "' has an unknown dtype ", tensor.dtype));
    }
    if (tensor.name == kMetadataKey || header.contains(tensor.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name '", tensor.name, "' is repeated or reserved"));
    }
    const int64_t expected = TensorBytes(tensor.shape, element_bytes);
    if (expected < 0 || static_cast<uint64_t>(expected) != tensor.bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", tensor.name, "' has ", tensor.bytes.size(), " bytes, ",
                       tensor.dtype, " ", ShapeString(tensor.shape), " needs ", expected));
    }
    header[tensor.name] = {{"dtype", tensor.dtype},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + tensor.bytes.size()}}};
    offset += tensor.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return ErrnoStatus(errno, "cannot create", path);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  out.write(reinterpret_cast<const char*>(length), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const SafetensorsTensorToWrite& tensor : tensors) {
    out.write(reinterpret_cast<const char*>(tensor.bytes.data()),
              static_cast<std::streamsize>(tensor.bytes.size()));
  }
  out.close();
  if (!out) return ErrnoStatus(errno, "cannot write", path);
  return absl::OkStatus();
}

}  // namespace dsa
