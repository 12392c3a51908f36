// A minimal .npy reader and writer (NumPy's array file format, versions 1.0-3.0 read, 1.0 written;
// little-endian, C order): the real model's token files (python_docs_*.npy, docs/model.md) and the
// forward tool's outputs. Shared by dsa-model-forward and `dsa replay --model smollm2`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dsa {

/// Parses the bytes of a .npy file of token ids: dtype "<u2" (uint16, what scripts/model_setup.sh
/// writes), "<i4" or "<i8", any shape, flattened in C order, as int32 ids. `name` prefixes every
/// error message (the file's path).
/// Errors: INVALID_ARGUMENT (not a .npy file, Fortran order, another dtype, a malformed shape, an
/// id outside [0, 2^31)), DATA_LOSS (a truncated header, or data bytes that do not match the
/// shape).
absl::StatusOr<std::vector<int32_t>> ParseTokensNpy(absl::string_view bytes,
                                                    absl::string_view name);

/// Reads `path` and parses it with ParseTokensNpy. NOT_FOUND when it cannot be opened.
absl::StatusOr<std::vector<int32_t>> ReadTokensNpy(const std::string& path);

/// Writes a C-order .npy (format version 1.0) of dtype `descr` (e.g. "<f4", "<i4") and `shape`
/// from `bytes` bytes at `data` (product(shape) elements of descr's size; not checked).
/// Errors: PERMISSION_DENIED (cannot create), DATA_LOSS (the write failed).
absl::Status WriteNpy(const std::string& path, absl::string_view descr,
                      const std::vector<int64_t>& shape, const void* data, size_t bytes);

}  // namespace dsa
