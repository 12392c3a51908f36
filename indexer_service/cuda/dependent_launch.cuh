// Programmatic dependent launch (PDL, sm_90) for the kernels of one select. A kernel launched
// with cudaLaunchAttributeProgrammaticStreamSerialization may be placed on the SMs while the kernel
// before it on the stream still runs (once every CTA of that kernel has triggered, or exited), and
// waits in hardware (griddepcontrol.wait) for that kernel's completion and memory flush, instead of
// being launched only after it. The select is a chain of up to ten dependent kernels (select.cu);
// at one row most of them take a few microseconds, so the gaps between them are a large part of
// the whole (docs/history/gpu_kernels_steps.md, step 15).
//
// The contract every kernel launched by LaunchDependent keeps: it calls BeginDependentKernel()
// in every thread before its first read of memory that an earlier kernel on the stream writes,
// and before any early return. Waiting in every CTA keeps completion transitive: a kernel
// completes only after its predecessor did, so the one after it sees the writes of all of them.
// A kernel launched without the attribute (a plain launch, top-K, or DSA_CUDA_NO_PDL) is ordered
// by the stream as usual and its wait is a no-op; its trigger still lets a PDL-launched kernel
// after it start early.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace dsa::cuda {

/// Lets the next kernel on the stream be launched (griddepcontrol.launch_dependents), then waits
/// until every prerequisite grid has completed and its writes are visible (griddepcontrol.wait).
/// Call it in every thread, first thing.
__device__ inline void BeginDependentKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// The kernels launched through LaunchDependent, by the names DSA_CUDA_NO_PDL takes.
inline constexpr const char* kDependentKernelNames[] = {
    "setup", "fill",  "layout",  "compact", "keep_all_layout", "layout_lists", "predict",
    "plan",  "union", "prepare", "scan",    "update"};

/// Whether launches of the kernel named `name` carry the PDL attribute: yes unless the environment
/// variable DSA_CUDA_NO_PDL is "all" (or "1"), or a comma-separated list of kDependentKernelNames
/// that names it (read once; for A/B timing of one binary; spaces around names are ignored, and an
/// unknown name is reported once on stderr). Top-K is launched without the attribute (topk.cu).
inline bool DependentLaunchEnabled(const char* name) {
  struct Off {
    bool all = false;
    std::vector<std::string> names;
  };
  static const Off off = [] {
    Off parsed;
    const char* value = std::getenv("DSA_CUDA_NO_PDL");
    if (value == nullptr) return parsed;
    const std::string text = value;
    if (text == "all" || text == "1") {
      parsed.all = true;
      return parsed;
    }
    size_t start = 0;
    while (start <= text.size()) {
      size_t end = text.find(',', start);
      if (end == std::string::npos) end = text.size();
      const size_t first = text.find_first_not_of(' ', start);
      const size_t last = text.find_last_not_of(' ', end == 0 ? 0 : end - 1);
      if (first < end && last != std::string::npos && last >= first) {
        const std::string token = text.substr(first, last - first + 1);
        bool known = false;
        for (const char* n : kDependentKernelNames) known = known || token == n;
        if (!known) {
          std::fprintf(stderr, "DSA_CUDA_NO_PDL: no kernel is called '%s' (ignored)\n",
                       token.c_str());
        }
        parsed.names.push_back(token);
      }
      start = end + 1;
    }
    return parsed;
  }();
  if (off.all) return false;
  for (const std::string& n : off.names) {
    if (n == name) return false;
  }
  return true;
}

/// Launches `kernel` (called `name` in DSA_CUDA_NO_PDL) on `stream` with the PDL attribute. The
/// kernel must begin with BeginDependentKernel(). Returns cudaLaunchKernelEx's error, and clears
/// it from cudaGetLastError (as `kernel<<<...>>>; return cudaGetLastError();` did), so that a later
/// launch does not report it again.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchDependent(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = DependentLaunchEnabled(name) ? 1 : 0;
  const cudaError_t error = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (error != cudaSuccess) (void)cudaGetLastError();
  return error;
}

}  // namespace dsa::cuda
