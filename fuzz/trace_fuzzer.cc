// libFuzzer harness of the trace readers (tools/dsa/trace.h): the input is a trace file's bytes,
// read as Mooncake JSON lines (DSA_FUZZ_AZURE undefined) or as the Azure CSV. Checks: never a
// crash or a sanitizer report; an accepted trace is what the readers promise (arrivals from 0,
// never going backwards, lengths >= 1, at most ceil(context / 512) prefix ids).
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "tools/dsa/trace.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
#ifdef DSA_FUZZ_AZURE
  auto trace = dsa::ReadAzureTrace(in);
#else
  auto trace = dsa::ReadMooncakeTrace(in);
#endif
  if (!trace.ok()) {
    Check(trace.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  Check(!trace->empty());
  Check((*trace)[0].arrival_ms == 0);
  int64_t last = 0;
  for (const dsa::TraceRequest& request : *trace) {
    Check(request.arrival_ms >= last);
    last = request.arrival_ms;
    Check(request.context_tokens >= 1 && request.output_tokens >= 1);
    const int64_t blocks =
        (request.context_tokens + dsa::kPrefixBlockTokens - 1) / dsa::kPrefixBlockTokens;
    Check(static_cast<int64_t>(request.prefix_block_ids.size()) <= blocks);
  }
  return 0;
}
