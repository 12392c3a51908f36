// The NCCL data plane's wire format (see nccl_wire.h).
#include "transport/nccl_wire.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dsa {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian and packs with memcpy");

// Header layout: byte offsets of the fields.
constexpr size_t kMagicAt = 0, kVersionAt = 4, kKindAt = 6, kRequestIdAt = 8, kPayloadAt = 16,
                 kResponseAt = 24, kGroupsAt = 32, kHeadsAt = 36, kDimAt = 40, kCodeAt = 44,
                 kAppliedAt = 48, kChecksumAt = 60;
// Per-group records at the start of a payload.
constexpr int64_t kRequestRecordBytes = 32;    // u64 sequence, i32 layer, i32 rows, i64 t, i64 keys
constexpr int64_t kSelectionRecordBytes = 32;  // i32 rows, i32 K, i64 scored, i64 visible, u8 x2
constexpr int64_t kMaxPosition = int64_t{1} << 31;  // a layer's slots are int32
constexpr int kMaxHeadsOrDim = 1024;                // the Indexer's bound on H and D

template <typename T>
void Put(std::span<uint8_t> out, size_t at, T value) {
  std::memcpy(out.data() + at, &value, sizeof(T));
}
template <typename T>
T Get(std::span<const uint8_t> in, size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

// FNV-1a over the header's bytes before the checksum.
uint32_t HeaderChecksum(std::span<const uint8_t> header) {
  uint32_t hash = 2166136261u;
  for (size_t i = 0; i < kChecksumAt; ++i) hash = (hash ^ header[i]) * 16777619u;
  return hash;
}

int64_t AlignUp(int64_t offset) {
  return (offset + kWireAlignment - 1) / kWireAlignment * kWireAlignment;
}

// Lays tensors out one after another, each on a kWireAlignment offset.
struct Layout {
  int64_t end = 0;
  int64_t Take(int64_t bytes) {
    const int64_t at = AlignUp(end);
    end = at + bytes;
    return at;
  }
};

// One request group's record and the byte sizes of its tensors.
struct RequestGroupShape {
  int64_t rows = 0;
  int64_t new_keys = 0;
};

// Offsets of every group's queries, weights and keys; the payload's size in `layout.end`.
struct RequestOffsets {
  std::vector<int64_t> queries, weights, keys;
  int64_t payload_bytes = 0;
};
RequestOffsets LayOutRequest(std::span<const RequestGroupShape> groups, int64_t num_heads,
                             int64_t head_dim) {
  RequestOffsets offsets;
  Layout layout{static_cast<int64_t>(groups.size()) * kRequestRecordBytes};
  for (const RequestGroupShape& group : groups) {
    offsets.queries.push_back(layout.Take(group.rows * num_heads * head_dim * 4));
    offsets.weights.push_back(layout.Take(group.rows * num_heads * 4));
    offsets.keys.push_back(layout.Take(group.new_keys * head_dim * 4));
  }
  offsets.payload_bytes = layout.end;
  return offsets;
}

struct SelectionGroupShape {
  int64_t rows = 0;
  int64_t top_k = 0;
  bool audited = false;
};
struct SelectionOffsets {
  std::vector<int64_t> selections, audits;
  int64_t payload_bytes = 0;
};
SelectionOffsets LayOutSelection(std::span<const SelectionGroupShape> groups) {
  SelectionOffsets offsets;
  Layout layout{static_cast<int64_t>(groups.size()) * kSelectionRecordBytes};
  for (const SelectionGroupShape& group : groups) {
    offsets.selections.push_back(layout.Take(group.rows * group.top_k * 4));
    offsets.audits.push_back(layout.Take(group.audited ? group.rows * 8 : 0));
  }
  offsets.payload_bytes = layout.end;
  return offsets;
}

absl::Status CheckRows(int64_t rows, const WireLimits& limits, const std::string& where) {
  if (rows < 1) return absl::InvalidArgumentError(absl::StrCat(where, "num_rows ", rows, " < 1"));
  if (rows > limits.max_rows_per_group) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where, "num_rows ", rows, " over max_rows_per_group ", limits.max_rows_per_group));
  }
  return absl::OkStatus();
}

absl::Status CheckGroupFields(int64_t layer, int64_t first_position, int64_t num_rows,
                              int64_t num_new_keys, const WireLimits& limits,
                              const std::string& where) {
  DSA_RETURN_IF_ERROR(CheckRows(num_rows, limits, where));
  if (layer < 0 || layer >= kMaxPosition) {
    return absl::InvalidArgumentError(absl::StrCat(where, "layer ", layer, " outside [0, 2^31)"));
  }
  if (first_position < 0 || first_position >= kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "first_position ", first_position, " outside [0, 2^31)"));
  }
  if (num_new_keys < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, num_new_keys, " new index keys"));
  }
  if (num_new_keys > limits.max_new_keys_per_group) {
    return absl::ResourceExhaustedError(absl::StrCat(where, num_new_keys,
                                                     " new index keys over max_new_keys_per_group ",
                                                     limits.max_new_keys_per_group));
  }
  return absl::OkStatus();
}

absl::Status CheckHeadsAndDim(int64_t num_heads, int64_t head_dim) {
  if (num_heads < 1 || num_heads > kMaxHeadsOrDim || head_dim < 1 || head_dim > kMaxHeadsOrDim) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads ", num_heads, " / head_dim ",
                                                   head_dim, " outside [1, ", kMaxHeadsOrDim, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckPayloadHolds(const WireHeader& header, std::span<const uint8_t> payload) {
  if (static_cast<int64_t>(payload.size()) < header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload of ", payload.size(), " bytes, the header announces ", header.payload_bytes));
  }
  return absl::OkStatus();
}

void CopyFloats(std::span<const float> values, std::span<uint8_t> out, int64_t at) {
  if (!values.empty()) std::memcpy(out.data() + at, values.data(), values.size_bytes());
}

}  // namespace

void EncodeWireHeader(const WireHeader& header, std::span<uint8_t> out) {
  std::fill(out.begin(), out.begin() + kWireHeaderBytes, 0);
  Put<uint32_t>(out, kMagicAt, kWireMagic);
  Put<uint16_t>(out, kVersionAt, kWireVersion);
  Put<uint16_t>(out, kKindAt, static_cast<uint16_t>(header.kind));
  Put<uint64_t>(out, kRequestIdAt, header.request_id);
  Put<int64_t>(out, kPayloadAt, header.payload_bytes);
  Put<int64_t>(out, kResponseAt, header.response_bytes);
  Put<int32_t>(out, kGroupsAt, header.num_groups);
  Put<int32_t>(out, kHeadsAt, header.num_heads);
  Put<int32_t>(out, kDimAt, header.head_dim);
  Put<int32_t>(out, kCodeAt, header.status_code);
  Put<int32_t>(out, kAppliedAt, header.groups_applied);
  Put<uint32_t>(out, kChecksumAt, HeaderChecksum(out));
}

absl::StatusOr<WireHeader> DecodeWireHeader(std::span<const uint8_t> bytes,
                                            const WireLimits& limits) {
  if (static_cast<int64_t>(bytes.size()) < kWireHeaderBytes) {
    return absl::InternalError(absl::StrCat("truncated data-plane header: ", bytes.size(),
                                            " bytes, a header has ", kWireHeaderBytes));
  }
  if (const uint32_t magic = Get<uint32_t>(bytes, kMagicAt); magic != kWireMagic) {
    return absl::InternalError(
        absl::StrCat("not a dsa data-plane header (magic 0x", absl::Hex(magic), ")"));
  }
  if (Get<uint32_t>(bytes, kChecksumAt) != HeaderChecksum(bytes)) {
    return absl::InternalError("data-plane header checksum mismatch (corrupt message)");
  }
  if (const uint16_t version = Get<uint16_t>(bytes, kVersionAt); version != kWireVersion) {
    return absl::InternalError(
        absl::StrCat("data-plane wire version ", version, "; this side speaks ", kWireVersion));
  }
  WireHeader header;
  const uint16_t kind = Get<uint16_t>(bytes, kKindAt);
  if (kind < static_cast<uint16_t>(WireKind::kRequest) ||
      kind > static_cast<uint16_t>(WireKind::kClose)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown data-plane message kind ", kind));
  }
  header.kind = static_cast<WireKind>(kind);
  header.request_id = Get<uint64_t>(bytes, kRequestIdAt);
  header.payload_bytes = Get<int64_t>(bytes, kPayloadAt);
  header.response_bytes = Get<int64_t>(bytes, kResponseAt);
  header.num_groups = Get<int32_t>(bytes, kGroupsAt);
  header.num_heads = Get<int32_t>(bytes, kHeadsAt);
  header.head_dim = Get<int32_t>(bytes, kDimAt);
  header.status_code = Get<int32_t>(bytes, kCodeAt);
  header.groups_applied = Get<int32_t>(bytes, kAppliedAt);

  if (header.payload_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("payload_bytes ", header.payload_bytes, " < 0"));
  }
  if (header.payload_bytes > limits.max_message_bytes - kWireHeaderBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("a payload of ", header.payload_bytes,
                                                     " bytes passes max_message_bytes ",
                                                     limits.max_message_bytes));
  }
  switch (header.kind) {
    case WireKind::kRequest:
    case WireKind::kSelection: {
      if (header.num_groups < 1) {
        return absl::InvalidArgumentError(absl::StrCat("num_groups ", header.num_groups, " < 1"));
      }
      if (header.num_groups > limits.max_groups) {
        return absl::ResourceExhaustedError(
            absl::StrCat("num_groups ", header.num_groups, " over max_groups ", limits.max_groups));
      }
      const int64_t records =
          int64_t{header.num_groups} *
          (header.kind == WireKind::kRequest ? kRequestRecordBytes : kSelectionRecordBytes);
      if (header.payload_bytes < records) {
        return absl::InvalidArgumentError(absl::StrCat("payload of ", header.payload_bytes,
                                                       " bytes cannot hold ", header.num_groups,
                                                       " group records"));
      }
      if (header.kind == WireKind::kRequest) {
        DSA_RETURN_IF_ERROR(CheckHeadsAndDim(header.num_heads, header.head_dim));
        if (header.response_bytes < kWireHeaderBytes + kMaxWireErrorMessageBytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("response_bytes ", header.response_bytes, " below the ",
                           kWireHeaderBytes + kMaxWireErrorMessageBytes, " an error answer needs"));
        }
        if (header.response_bytes > limits.max_message_bytes) {
          return absl::ResourceExhaustedError(absl::StrCat("response_bytes ", header.response_bytes,
                                                           " passes max_message_bytes ",
                                                           limits.max_message_bytes));
        }
      }
      break;
    }
    case WireKind::kError:
      if (header.status_code <= 0 || header.status_code > 16) {
        return absl::InvalidArgumentError(
            absl::StrCat("error answer with status code ", header.status_code));
      }
      if (header.groups_applied < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("error answer with groups_applied ", header.groups_applied));
      }
      if (header.payload_bytes > kMaxWireErrorMessageBytes) {
        return absl::InvalidArgumentError(absl::StrCat("error message of ", header.payload_bytes,
                                                       " bytes over ", kMaxWireErrorMessageBytes));
      }
      break;
    case WireKind::kClose:
      if (header.payload_bytes != 0) {
        return absl::InvalidArgumentError("a close message carries no payload");
      }
      break;
  }
  return header;
}

int64_t WireResponseBytes(std::span<const int> rows_per_group, const WireLimits& limits) {
  std::vector<SelectionGroupShape> shapes;
  shapes.reserve(rows_per_group.size());
  for (const int rows : rows_per_group) shapes.push_back({rows, limits.max_top_k, true});
  return kWireHeaderBytes +
         std::max(kMaxWireErrorMessageBytes, LayOutSelection(shapes).payload_bytes);
}

absl::StatusOr<WireRequestSizes> SizeWireRequest(const LayerSelectRequest& request,
                                                 const WireLimits& limits) {
  if (request.groups.empty()) {
    return absl::InvalidArgumentError("select needs at least one group");
  }
  if (static_cast<int64_t>(request.groups.size()) > limits.max_groups) {
    return absl::ResourceExhaustedError(
        absl::StrCat(request.groups.size(), " groups over max_groups ", limits.max_groups));
  }
  DSA_RETURN_IF_ERROR(CheckHeadsAndDim(request.num_heads, request.head_dim));
  const int64_t num_heads = request.num_heads, head_dim = request.head_dim;
  std::vector<RequestGroupShape> shapes(request.groups.size());
  std::vector<int> rows(request.groups.size());
  for (size_t g = 0; g < request.groups.size(); ++g) {
    const SelectRowGroup& group = request.groups[g];
    const std::string where = absl::StrCat("group ", g, ": ");
    const int64_t num_keys = static_cast<int64_t>(group.new_index_keys.size()) / head_dim;
    DSA_RETURN_IF_ERROR(CheckGroupFields(group.layer, group.first_position, group.num_rows,
                                         num_keys, limits, where));
    if (static_cast<int64_t>(group.queries.size()) != group.num_rows * num_heads * head_dim ||
        static_cast<int64_t>(group.head_weights.size()) != group.num_rows * num_heads ||
        static_cast<int64_t>(group.new_index_keys.size()) % head_dim != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "queries of ", group.queries.size(), " values, head_weights of ",
          group.head_weights.size(), ", new_index_keys of ", group.new_index_keys.size(),
          " do not match num_rows ", group.num_rows, ", H ", num_heads, ", D ", head_dim));
    }
    shapes[g] = {group.num_rows, num_keys};
    rows[g] = group.num_rows;
  }
  WireRequestSizes sizes;
  sizes.payload_bytes = LayOutRequest(shapes, num_heads, head_dim).payload_bytes;
  if (kWireHeaderBytes + sizes.payload_bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a request of ", kWireHeaderBytes + sizes.payload_bytes,
                     " bytes passes max_message_bytes ", limits.max_message_bytes));
  }
  sizes.response_bytes = WireResponseBytes(rows, limits);
  if (sizes.response_bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the answer to this request (", sizes.response_bytes, " bytes at max_top_k ",
                     limits.max_top_k, ") passes max_message_bytes ", limits.max_message_bytes));
  }
  return sizes;
}

void PackWireRequest(const LayerSelectRequest& request, uint64_t request_id,
                     const WireRequestSizes& sizes, std::span<uint8_t> out) {
  WireHeader header;
  header.kind = WireKind::kRequest;
  header.request_id = request_id;
  header.payload_bytes = sizes.payload_bytes;
  header.response_bytes = sizes.response_bytes;
  header.num_groups = static_cast<int32_t>(request.groups.size());
  header.num_heads = request.num_heads;
  header.head_dim = request.head_dim;
  EncodeWireHeader(header, out);
  const std::span<uint8_t> payload = out.subspan(kWireHeaderBytes, sizes.payload_bytes);
  std::vector<RequestGroupShape> shapes;
  shapes.reserve(request.groups.size());
  for (const SelectRowGroup& group : request.groups) {
    shapes.push_back(
        {group.num_rows, static_cast<int64_t>(group.new_index_keys.size()) / request.head_dim});
  }
  const RequestOffsets offsets = LayOutRequest(shapes, request.num_heads, request.head_dim);
  std::fill(payload.begin(), payload.end(), 0);  // the alignment padding
  for (size_t g = 0; g < request.groups.size(); ++g) {
    const SelectRowGroup& group = request.groups[g];
    const size_t at = g * kRequestRecordBytes;
    Put<uint64_t>(payload, at, group.sequence_id);
    Put<int32_t>(payload, at + 8, group.layer);
    Put<int32_t>(payload, at + 12, group.num_rows);
    Put<int64_t>(payload, at + 16, group.first_position);
    Put<int64_t>(payload, at + 24, shapes[g].new_keys);
    CopyFloats(group.queries, payload, offsets.queries[g]);
    CopyFloats(group.head_weights, payload, offsets.weights[g]);
    CopyFloats(group.new_index_keys, payload, offsets.keys[g]);
  }
}

absl::StatusOr<LayerSelectRequest> UnpackWireRequest(const WireHeader& header,
                                                     std::span<const uint8_t> bytes,
                                                     const WireLimits& limits) {
  DSA_RETURN_IF_ERROR(CheckPayloadHolds(header, bytes));
  const std::span<const uint8_t> payload = bytes.first(header.payload_bytes);
  const int64_t num_groups = header.num_groups;
  if (num_groups < 1 || num_groups * kRequestRecordBytes > header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload of ", header.payload_bytes, " bytes cannot hold ", num_groups, " group records"));
  }
  DSA_RETURN_IF_ERROR(CheckHeadsAndDim(header.num_heads, header.head_dim));
  LayerSelectRequest request;
  request.num_heads = header.num_heads;
  request.head_dim = header.head_dim;
  request.groups.resize(num_groups);
  std::vector<RequestGroupShape> shapes(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const size_t at = g * kRequestRecordBytes;
    SelectRowGroup& group = request.groups[g];
    group.sequence_id = Get<uint64_t>(payload, at);
    const int32_t layer = Get<int32_t>(payload, at + 8);
    const int32_t rows = Get<int32_t>(payload, at + 12);
    const int64_t first_position = Get<int64_t>(payload, at + 16);
    const int64_t new_keys = Get<int64_t>(payload, at + 24);
    DSA_RETURN_IF_ERROR(CheckGroupFields(layer, first_position, rows, new_keys, limits,
                                         absl::StrCat("group ", g, ": ")));
    group.layer = layer;
    group.num_rows = rows;
    group.first_position = first_position;
    shapes[g] = {rows, new_keys};
  }
  const RequestOffsets offsets = LayOutRequest(shapes, header.num_heads, header.head_dim);
  if (offsets.payload_bytes != header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("request payload of ", header.payload_bytes,
                                                   " bytes, its groups' tensors take ",
                                                   offsets.payload_bytes));
  }
  auto read_floats = [&](int64_t at, int64_t count, std::vector<float>& values) {
    values.resize(count);
    if (count > 0) std::memcpy(values.data(), payload.data() + at, count * sizeof(float));
  };
  const int64_t num_heads = header.num_heads, head_dim = header.head_dim;
  for (int64_t g = 0; g < num_groups; ++g) {
    SelectRowGroup& group = request.groups[g];
    read_floats(offsets.queries[g], shapes[g].rows * num_heads * head_dim, group.queries);
    read_floats(offsets.weights[g], shapes[g].rows * num_heads, group.head_weights);
    read_floats(offsets.keys[g], shapes[g].new_keys * head_dim, group.new_index_keys);
  }
  return request;
}

absl::StatusOr<int64_t> SizeWireSelection(const LayerSelection& selection,
                                          const WireLimits& limits) {
  if (selection.groups.empty() ||
      static_cast<int64_t>(selection.groups.size()) > limits.max_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("a selection of ", selection.groups.size(), " groups"));
  }
  std::vector<SelectionGroupShape> shapes(selection.groups.size());
  for (size_t g = 0; g < selection.groups.size(); ++g) {
    const GroupSelection& group = selection.groups[g];
    const std::string where = absl::StrCat("group ", g, ": ");
    DSA_RETURN_IF_ERROR(CheckRows(group.num_rows, limits, where));
    if (group.top_k < 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, "top_k ", group.top_k, " < 1"));
    }
    if (group.top_k > limits.max_top_k) {
      return absl::ResourceExhaustedError(absl::StrCat(
          where, "top_k ", group.top_k, " over the data plane's max_top_k ", limits.max_top_k));
    }
    const bool audited = !group.audit_miss_rates.empty();
    if (static_cast<int64_t>(group.selections.size()) != int64_t{group.num_rows} * group.top_k ||
        (audited && static_cast<int>(group.audit_miss_rates.size()) != group.num_rows)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, group.selections.size(), " selections and ", group.audit_miss_rates.size(),
          " audit miss rates for ", group.num_rows, " rows of top_k ", group.top_k));
    }
    shapes[g] = {group.num_rows, group.top_k, audited};
  }
  return LayOutSelection(shapes).payload_bytes;
}

void PackWireSelection(const LayerSelection& selection, uint64_t request_id, int64_t payload_bytes,
                       std::span<uint8_t> out) {
  WireHeader header;
  header.kind = WireKind::kSelection;
  header.request_id = request_id;
  header.payload_bytes = payload_bytes;
  header.num_groups = static_cast<int32_t>(selection.groups.size());
  EncodeWireHeader(header, out);
  const std::span<uint8_t> payload = out.subspan(kWireHeaderBytes);
  std::fill(payload.begin(), payload.end(), 0);  // alignment and answer padding
  std::vector<SelectionGroupShape> shapes;
  shapes.reserve(selection.groups.size());
  for (const GroupSelection& group : selection.groups) {
    shapes.push_back({group.num_rows, group.top_k, !group.audit_miss_rates.empty()});
  }
  const SelectionOffsets offsets = LayOutSelection(shapes);
  for (size_t g = 0; g < selection.groups.size(); ++g) {
    const GroupSelection& group = selection.groups[g];
    const size_t at = g * kSelectionRecordBytes;
    Put<int32_t>(payload, at, group.num_rows);
    Put<int32_t>(payload, at + 4, group.top_k);
    Put<int64_t>(payload, at + 8, group.blocks_scored);
    Put<int64_t>(payload, at + 16, group.blocks_visible);
    Put<uint8_t>(payload, at + 24, group.all_blocks ? 1 : 0);
    Put<uint8_t>(payload, at + 25, shapes[g].audited ? 1 : 0);
    std::memcpy(payload.data() + offsets.selections[g], group.selections.data(),
                group.selections.size() * sizeof(int32_t));
    if (!group.audit_miss_rates.empty()) {
      std::memcpy(payload.data() + offsets.audits[g], group.audit_miss_rates.data(),
                  group.audit_miss_rates.size() * sizeof(double));
    }
  }
}

absl::StatusOr<LayerSelection> UnpackWireSelection(const WireHeader& header,
                                                   std::span<const uint8_t> bytes,
                                                   const WireLimits& limits) {
  DSA_RETURN_IF_ERROR(CheckPayloadHolds(header, bytes));
  const std::span<const uint8_t> payload = bytes.first(header.payload_bytes);
  const int64_t num_groups = header.num_groups;
  if (num_groups < 1 || num_groups * kSelectionRecordBytes > header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("payload of ", header.payload_bytes,
                                                   " bytes cannot hold ", num_groups,
                                                   " selection records"));
  }
  LayerSelection selection;
  selection.groups.resize(num_groups);
  std::vector<SelectionGroupShape> shapes(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const size_t at = g * kSelectionRecordBytes;
    const std::string where = absl::StrCat("selection group ", g, ": ");
    GroupSelection& group = selection.groups[g];
    group.num_rows = Get<int32_t>(payload, at);
    group.top_k = Get<int32_t>(payload, at + 4);
    group.blocks_scored = Get<int64_t>(payload, at + 8);
    group.blocks_visible = Get<int64_t>(payload, at + 16);
    const uint8_t all_blocks = Get<uint8_t>(payload, at + 24);
    const uint8_t audited = Get<uint8_t>(payload, at + 25);
    DSA_RETURN_IF_ERROR(CheckRows(group.num_rows, limits, where));
    if (group.top_k < 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, "top_k ", group.top_k, " < 1"));
    }
    if (group.top_k > limits.max_top_k) {
      return absl::ResourceExhaustedError(
          absl::StrCat(where, "top_k ", group.top_k, " over max_top_k ", limits.max_top_k));
    }
    if (group.blocks_visible < 0 || group.blocks_scored < 0 ||
        group.blocks_scored > group.blocks_visible || all_blocks > 1 || audited > 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, "blocks scored ", group.blocks_scored,
                                                     " of ", group.blocks_visible,
                                                     " visible, flags ", all_blocks, "/", audited));
    }
    group.all_blocks = all_blocks == 1;
    shapes[g] = {group.num_rows, group.top_k, audited == 1};
  }
  const SelectionOffsets offsets = LayOutSelection(shapes);
  if (offsets.payload_bytes != header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("selection payload of ", header.payload_bytes,
                                                   " bytes, its groups take ",
                                                   offsets.payload_bytes));
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    GroupSelection& group = selection.groups[g];
    group.selections.resize(shapes[g].rows * shapes[g].top_k);
    std::memcpy(group.selections.data(), payload.data() + offsets.selections[g],
                group.selections.size() * sizeof(int32_t));
    for (const int32_t slot : group.selections) {
      if (slot < -1) {
        return absl::InvalidArgumentError(
            absl::StrCat("selection group ", g, ": slot ", slot, " (below the -1 padding)"));
      }
    }
    if (shapes[g].audited) {
      group.audit_miss_rates.resize(shapes[g].rows);
      std::memcpy(group.audit_miss_rates.data(), payload.data() + offsets.audits[g],
                  group.audit_miss_rates.size() * sizeof(double));
      for (const double rate : group.audit_miss_rates) {
        if (!(rate >= 0 && rate <= 1)) {
          return absl::InvalidArgumentError(
              absl::StrCat("selection group ", g, ": audit miss rate ", rate, " outside [0, 1]"));
        }
      }
    }
  }
  return selection;
}

void PackWireError(const absl::Status& status, int groups_applied, uint64_t request_id,
                   std::span<uint8_t> out) {
  const int64_t room = std::min<int64_t>(kMaxWireErrorMessageBytes,
                                         static_cast<int64_t>(out.size()) - kWireHeaderBytes);
  const int64_t length = std::min<int64_t>(room, static_cast<int64_t>(status.message().size()));
  WireHeader header;
  header.kind = WireKind::kError;
  header.request_id = request_id;
  header.payload_bytes = length;
  header.status_code = status.ok() ? static_cast<int32_t>(absl::StatusCode::kInternal)
                                   : static_cast<int32_t>(status.code());
  header.groups_applied = groups_applied;
  EncodeWireHeader(header, out);
  const std::span<uint8_t> payload = out.subspan(kWireHeaderBytes);
  std::fill(payload.begin(), payload.end(), 0);
  if (length > 0) std::memcpy(payload.data(), status.message().data(), length);
}

absl::Status UnpackWireError(const WireHeader& header, std::span<const uint8_t> payload) {
  if (static_cast<int64_t>(payload.size()) < header.payload_bytes) {
    return absl::InternalError(absl::StrCat("error answer of ", payload.size(),
                                            " bytes, its header announces ", header.payload_bytes));
  }
  absl::Status status(
      static_cast<absl::StatusCode>(header.status_code),
      std::string(reinterpret_cast<const char*>(payload.data()), header.payload_bytes));
  status.SetPayload(kGroupsAppliedPayload, absl::Cord(absl::StrCat(header.groups_applied)));
  return status;
}

void PackWireClose(std::span<uint8_t> out) {
  WireHeader header;
  header.kind = WireKind::kClose;
  EncodeWireHeader(header, out);
}

WireSelectHandler WithOwnerCheck(WireSelectHandler handler, SequenceOwnerCheck check_owned) {
  if (!check_owned) return handler;
  return [handler = std::move(handler), check_owned = std::move(check_owned)](
             const LayerSelectRequest& request,
             int* groups_applied) -> absl::StatusOr<LayerSelection> {
    for (const SelectRowGroup& group : request.groups) {
      if (absl::Status owned = check_owned(group.sequence_id); !owned.ok()) {
        if (groups_applied != nullptr) *groups_applied = 0;
        return owned;
      }
    }
    return handler(request, groups_applied);
  };
}

void AnswerWireRequest(const WireSelectHandler& handler, const WireHeader& header,
                       std::span<const uint8_t> payload, const WireLimits& limits,
                       std::span<uint8_t> out) {
  absl::StatusOr<LayerSelectRequest> request = UnpackWireRequest(header, payload, limits);
  if (!request.ok()) {
    PackWireError(request.status(), 0, header.request_id, out);
    return;
  }
  int groups_applied = 0;
  absl::StatusOr<LayerSelection> selection = handler(*request, &groups_applied);
  if (!selection.ok()) {
    PackWireError(selection.status(), groups_applied, header.request_id, out);
    return;
  }
  absl::StatusOr<int64_t> payload_bytes = SizeWireSelection(*selection, limits);
  if (payload_bytes.ok() && kWireHeaderBytes + *payload_bytes > static_cast<int64_t>(out.size())) {
    payload_bytes = absl::ResourceExhaustedError(
        absl::StrCat("a selection of ", *payload_bytes, " bytes does not fit the ", out.size(),
                     "-byte answer the request was sized for (max_top_k ", limits.max_top_k, ")"));
  }
  if (!payload_bytes.ok()) {
    PackWireError(payload_bytes.status(), static_cast<int>(request->groups.size()),
                  header.request_id, out);
    return;
  }
  PackWireSelection(*selection, header.request_id, *payload_bytes, out);
}

}  // namespace dsa
