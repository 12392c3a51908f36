// A read-only view of a safetensors file (the format of the real model's weights, docs/model.md):
// the file mapped into memory, its JSON header parsed and checked, tensors looked up by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dsa {

/// One tensor of a safetensors file.
struct SafetensorsTensor {
  /// The header's dtype string: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64",
  /// "U32", "U16", "U8", "BOOL", "F8_E4M3" or "F8_E5M2".
  std::string dtype;
  /// The shape, outermost first (row-major); empty for a scalar.
  std::vector<int64_t> shape;
  /// The raw little-endian bytes: exactly product(shape) * SafetensorsDtypeBytes(dtype) of them,
  /// inside the file's mapping (valid while the SafetensorsFile lives). Not necessarily aligned
  /// to the element size: copy (memcpy) rather than cast.
  std::span<const std::byte> bytes;

  /// product(shape) (1 for a scalar).
  int64_t num_elements() const;
};

/// Bytes of one element of a safetensors dtype string; 0 for a string the format does not define.
int SafetensorsDtypeBytes(std::string_view dtype);

/// An open safetensors file: little-endian u64 header length N, N bytes of JSON header (one object
/// per tensor with "dtype", "shape" and "data_offsets" [begin, end) relative to the data section,
/// plus an optional "__metadata__" object of string values), then the data section.
///
/// Open checks everything before it returns: the header length against the file, the JSON, every
/// dtype and shape, that each tensor's offsets lie inside the data section and span exactly
/// product(shape) x element bytes, and that the tensors cover the data section without a hole or
/// an overlap (the format's rule), so the file's size is exactly 8 + N + the data section's.
///
/// Immutable after Open; thread-safe. The mapping is private and read-only and lives as long as
/// the object.
class SafetensorsFile {
 public:
  /// Largest header length accepted (the reference implementation's limit).
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  /// Opens and maps `path`. Errors, each message naming the path:
  /// - NOT_FOUND: no such file; PERMISSION_DENIED / another errno code: it cannot be opened.
  /// - DATA_LOSS: the file is shorter than its header says (truncated): shorter than 8 bytes,
  ///   than 8 + N, or than 8 + N + the data section the tensors need; the message gives the
  ///   expected and the actual size in bytes.
  /// - INVALID_ARGUMENT: a malformed file: N above kMaxHeaderBytes, a header that is not a JSON
  ///   object, a tensor entry without a known dtype, a non-negative integer shape or two ordered
  ///   data offsets, offsets that disagree with dtype x shape, overlapping tensors or a hole in the
  ///   data section, bytes after the data section, non-string metadata values.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  /// The path given to Open.
  const std::string& path() const { return path_; }
  /// The file's size in bytes.
  uint64_t file_bytes() const { return file_bytes_; }
  /// The "__metadata__" map (empty when the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Every tensor by name.
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const SafetensorsTensor* Find(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  uint64_t file_bytes_ = 0;
  void* mapping_ = nullptr;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, SafetensorsTensor> tensors_;
};

/// One tensor to write with WriteSafetensors: `bytes` must hold product(shape) x element bytes of
/// `dtype`, little-endian.
struct SafetensorsTensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

/// Writes a safetensors file (header padded with spaces to a multiple of 8 bytes; tensors in the
/// given order). For tools and tests. Errors: INVALID_ARGUMENT (an unknown dtype, a size that
/// disagrees with the shape, a repeated or reserved name), or the errno's code when the file
/// cannot be written; messages name the path.
absl::Status WriteSafetensors(const std::string& path,
                              const std::map<std::string, std::string>& metadata,
                              std::span<const SafetensorsTensorToWrite> tensors);

}  // namespace dsa
