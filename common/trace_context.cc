// See trace_context.h.
#include "common/trace_context.h"

#include <cstdint>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"

namespace dsa {
namespace {

thread_local std::optional<TraceContext> current_context;

bool IsLowerHex(absl::string_view text) {
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool AllZero(absl::string_view text) {
  return text.find_first_not_of('0') == absl::string_view::npos;
}

// `digits` random lower-case hex digits, not all zero.
std::string RandomHex(int digits) {
  thread_local absl::BitGen gen;
  std::string out;
  while (out.empty() || AllZero(out)) {
    out.clear();
    for (int i = 0; i < digits; i += 16) {
      out += absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
    }
    out.resize(digits);
  }
  return out;
}

}  // namespace

std::string TraceContext::ToTraceparent() const {
  return absl::StrFormat("00-%s-%s-%02x", trace_id, parent_id, flags & 0xff);
}

TraceContext TraceContext::Child() const {
  TraceContext child = *this;
  child.parent_id = RandomHex(16);
  return child;
}

std::optional<TraceContext> ParseTraceparent(absl::string_view value) {
  // 00-<32 hex>-<16 hex>-<2 hex>
  if (value.size() != 55 || value.substr(0, 3) != "00-" || value[35] != '-' || value[52] != '-') {
    return std::nullopt;
  }
  const absl::string_view trace_id = value.substr(3, 32);
  const absl::string_view parent_id = value.substr(36, 16);
  const absl::string_view flags = value.substr(53, 2);
  if (!IsLowerHex(trace_id) || !IsLowerHex(parent_id) || !IsLowerHex(flags) || AllZero(trace_id) ||
      AllZero(parent_id)) {
    return std::nullopt;
  }
  TraceContext context;
  context.trace_id = std::string(trace_id);
  context.parent_id = std::string(parent_id);
  const auto hex = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  context.flags = hex(flags[0]) * 16 + hex(flags[1]);
  return context;
}

TraceContext NewTraceContext() {
  TraceContext context;
  context.trace_id = RandomHex(32);
  context.parent_id = RandomHex(16);
  context.flags = 1;
  return context;
}

std::optional<TraceContext> CurrentTraceContext() { return current_context; }

ScopedTraceContext::ScopedTraceContext(std::optional<TraceContext> context)
    : previous_(std::move(current_context)) {
  current_context = std::move(context);
}

ScopedTraceContext::~ScopedTraceContext() { current_context = std::move(previous_); }

}  // namespace dsa
