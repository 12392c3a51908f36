// One layer's select from the transport's plain structs (see layer_select.h).
#include "indexer_service/layer_select.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dsa {
namespace {

absl::Status CheckFinite(const std::vector<float>& values, const std::string& name) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

// One group checked, ready to run.
struct CheckedGroup {
  int64_t num_new_keys = 0;
  int64_t slots_before = 0;  // the layer's slot count when the request was checked
  std::vector<IndexerRow> rows;
};

// With `device` (the request's device form), the rows' queries are device rows from row_base on.
absl::Status CheckGroup(const Indexer& indexer, const SelectRowGroup& group, size_t index,
                        const DeviceSelectBuffers* device, int64_t row_base,
                        CheckedGroup* checked) {
  const int64_t num_heads = indexer.options().num_heads;
  const int64_t head_dim = indexer.options().head_dim;
  const std::string prefix = absl::StrCat("group ", index, ": ");
  const int64_t num_rows = group.num_rows;
  if (num_rows < 1) return absl::InvalidArgumentError(prefix + "queries have no rows");
  if (device != nullptr && !group.queries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "a device-form request carries its queries on the device, but the group holds ",
        group.queries.size(), " host values"));
  }
  if (device == nullptr &&
      group.queries.size() != static_cast<size_t>(num_rows * num_heads * head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "queries hold ", group.queries.size(),
                                                   " values, expected [", num_rows, ", ", num_heads,
                                                   ", ", head_dim, "]"));
  }
  if (group.head_weights.size() != static_cast<size_t>(num_rows * num_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "head_weights hold ",
                                                   group.head_weights.size(), " values, expected [",
                                                   num_rows, ", ", num_heads, "]"));
  }
  if (group.new_index_keys.size() % static_cast<size_t>(head_dim) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "new_index_keys hold ",
                                                   group.new_index_keys.size(),
                                                   " values, not a multiple of D = ", head_dim));
  }
  DSA_RETURN_IF_ERROR(CheckFinite(group.queries, prefix + "queries"));
  DSA_RETURN_IF_ERROR(CheckFinite(group.head_weights, prefix + "head_weights"));
  if (group.first_position < 0 || group.first_position >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "first_position ", group.first_position,
                                                   " outside [0, 2^31) (a layer's slots)"));
  }
  auto slots = indexer.NumSlots(group.sequence_id, group.layer);
  if (!slots.ok()) {
    return absl::Status(slots.status().code(), prefix + std::string(slots.status().message()));
  }
  checked->slots_before = *slots;
  const int64_t last_position = group.first_position + num_rows - 1;
  checked->num_new_keys = static_cast<int64_t>(group.new_index_keys.size()) / head_dim;
  if (checked->num_new_keys > 0) {
    DSA_RETURN_IF_ERROR(CheckFinite(group.new_index_keys, prefix + "new_index_keys"));
    const int64_t newest = *slots + checked->num_new_keys - 1;
    if (last_position != newest) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "rows end at position ", last_position, " but with ",
                       checked->num_new_keys, " new index keys layer ", group.layer,
                       "'s newest slot is ", newest, "; rows must end at the newest slot"));
    }
  }
  if (last_position >= *slots + checked->num_new_keys) {
    return absl::OutOfRangeError(absl::StrCat(prefix, "rows up to position ", last_position,
                                              " but layer ", group.layer, " holds ", *slots,
                                              " slots; append the rows' index keys first"));
  }
  const size_t query_size = static_cast<size_t>(num_heads * head_dim);
  checked->rows.resize(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (device != nullptr) {
      checked->rows[r].device_query =
          device->queries + static_cast<size_t>(row_base + r) * query_size;
    } else {
      checked->rows[r].query =
          std::span<const float>(group.queries.data() + r * query_size, query_size);
    }
    checked->rows[r].head_weights =
        std::span<const float>(group.head_weights.data() + r * num_heads, num_heads);
    checked->rows[r].position = group.first_position + r;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LayerSelection> RunLayerSelect(Indexer& indexer, const LayerSelectRequest& request,
                                              IndexerMetrics* metrics, int* groups_applied_out,
                                              std::function<void()> on_enqueued) {
  if (groups_applied_out != nullptr) *groups_applied_out = 0;
  if (request.groups.empty()) return absl::InvalidArgumentError("select needs at least one group");
  if (request.num_heads != indexer.options().num_heads ||
      request.head_dim != indexer.options().head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request's indexer inputs have H = ", request.num_heads, ", D = ", request.head_dim,
        " but this indexer has H = ", indexer.options().num_heads,
        ", D = ", indexer.options().head_dim));
  }
  const DeviceSelectBuffers* device = request.on_device() ? &request.device : nullptr;
  if (device != nullptr && (device->selections == nullptr || device->top_k < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a device-form request needs device selections and their K >= 1 (got K = ", device->top_k,
        device->selections == nullptr ? ", no selections buffer)" : ")"));
  }
  const int num_groups = static_cast<int>(request.groups.size());
  std::vector<CheckedGroup> checked(num_groups);
  std::vector<int64_t> row_base(num_groups + 1, 0);
  for (int g = 0; g < num_groups; ++g) {
    DSA_RETURN_IF_ERROR(
        CheckGroup(indexer, request.groups[g], g, device, row_base[g], &checked[g]));
    row_base[g + 1] = row_base[g] + request.groups[g].num_rows;
  }
  // New index keys make a (sequence, layer)'s slot count change within the request: such a layer
  // may appear in one group only.
  for (int g = 0; g < num_groups; ++g) {
    for (int h = 0; h < g; ++h) {
      const SelectRowGroup& a = request.groups[h];
      const SelectRowGroup& b = request.groups[g];
      if (a.sequence_id == b.sequence_id && a.layer == b.layer &&
          (checked[g].num_new_keys > 0 || checked[h].num_new_keys > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("groups ", h, " and ", g, " both address layer ", a.layer, " of sequence ",
                         a.sequence_id, " and carry new index keys"));
      }
    }
  }
  // The new keys, the selects and the undo of the appends of groups not applied run as one
  // SelectBatch under the Indexer's lock; each group's keys go at the slot count checked above
  // (another caller's append in between is refused, not interleaved).
  std::vector<SelectGroup> groups(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    groups[g] = {request.groups[g].sequence_id, request.groups[g].layer, checked[g].rows};
    if (checked[g].num_new_keys > 0) {
      groups[g].new_index_keys = request.groups[g].new_index_keys;
      groups[g].new_keys_first_slot = checked[g].slots_before;
    }
    if (device != nullptr) {
      groups[g].device_selections =
          device->selections + static_cast<size_t>(row_base[g]) * device->top_k;
    }
  }
  DeviceHandoff handoff;
  if (device != nullptr) {
    handoff.top_k = device->top_k;
    handoff.inputs_ready = device->queries_ready;
    handoff.selections_ready = device->selections_ready;
    handoff.on_enqueued = std::move(on_enqueued);
  }
  size_t groups_applied = 0;
  auto results =
      indexer.SelectBatch(groups, &groups_applied, device != nullptr ? &handoff : nullptr);
  if (!results.ok()) {
    if (groups_applied_out != nullptr) *groups_applied_out = static_cast<int>(groups_applied);
    return results.status();
  }
  LayerSelection selection;
  selection.groups.resize(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    SelectResult& result = (*results)[g];
    if (metrics != nullptr) metrics->RecordSelect(result);
    GroupSelection& out = selection.groups[g];
    out.num_rows = request.groups[g].num_rows;
    out.top_k = result.top_k;
    out.selections = std::move(result.selections);
    out.blocks_scored = result.blocks_scored;
    out.blocks_visible = result.blocks_visible;
    out.all_blocks = result.all_blocks;
    out.audit_miss_rates = std::move(result.audit_miss_rates);
  }
  return selection;
}

}  // namespace dsa
