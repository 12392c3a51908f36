// Programmatic dependent launch (PDL, sm_90) for the kernels of one select: each kernel is launched
// with cudaLaunchAttributeProgrammaticStreamSerialization, so the next kernel on the stream is
// placed on the SMs while its predecessor still runs, and waits in hardware (griddepcontrol.wait)
// for the predecessor's completion and memory flush instead of the launch that follows it. The
// select is a chain of up to ten dependent kernels (select.cu); at one row most of them are a few
// microseconds each, so the launch gap between them is a large part of the whole.
//
// The contract every kernel launched by LaunchDependent keeps: it calls BeginDependentKernel()
// in every thread before its first read of memory that an earlier kernel on the stream writes,
// and before any early return. Waiting in every CTA also keeps completion transitive: a kernel
// completes only after its predecessor did, so the one after it sees the writes of all of them.
// Without the launch attribute (a plain <<<>>> launch, or DSA_CUDA_NO_PDL set) the wait and the
// trigger are no-ops, so the kernels are correct either way.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

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

/// Whether launches of the kernel named `name` carry the PDL attribute: yes unless the environment
/// variable DSA_CUDA_NO_PDL is "all" (or "1"), or a comma-separated list that names it (read once;
/// for A/B timing of one binary). Names: setup, fill, layout, compact, predict, plan, union,
/// prepare, scan, update (top-K is launched without it: topk.cu says why).
inline bool DependentLaunchEnabled(const char* name) {
  static const char* const off = std::getenv("DSA_CUDA_NO_PDL");
  if (off == nullptr) return true;
  if (std::strcmp(off, "all") == 0 || std::strcmp(off, "1") == 0) return false;
  const size_t length = std::strlen(name);
  for (const char* at = off; *at != '\0';) {
    const char* end = std::strchr(at, ',');
    const size_t token = end == nullptr ? std::strlen(at) : static_cast<size_t>(end - at);
    if (token == length && std::strncmp(at, name, length) == 0) return false;
    if (end == nullptr) break;
    at = end + 1;
  }
  return true;
}

/// Launches `kernel` (called `name` in DSA_CUDA_NO_PDL) on `stream` with the PDL attribute. The
/// kernel must begin with BeginDependentKernel(). Returns cudaLaunchKernelEx's error (asynchronous;
/// launch errors also surface through cudaGetLastError).
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
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dsa::cuda
