// Loads the layer stand-in module (standin_module.h) into dsa-attention at run time and runs it as
// the CUDA backend's rest of each layer (CudaAttentionBackendOptions::rest_of_layer). Load it only
// after the /metrics server's threads exist (ServerSpec::before_serving): the module brings cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attention_worker/cuda/standin_module.h"

namespace dsa::cuda {

/// The module's file name; dsa-attention looks for it beside its own executable.
inline constexpr char kLayerStandinModuleName[] = "libdsa_layer_standin.so";

/// A loaded stand-in. Run is called on the backend's stream, one layer at a time.
class LoadedLayerStandin {
 public:
  /// dlopens `module_path` (RTLD_NOW | RTLD_LOCAL) and creates the stand-in with `config`.
  /// Errors: NOT_FOUND (no such module, or it lacks the entry points: dlerror's text),
  /// RESOURCE_EXHAUSTED (no room on the GPU for its weights), INTERNAL (another CUDA or cuBLAS
  /// error; the message says which).
  static absl::StatusOr<std::unique_ptr<LoadedLayerStandin>> Load(
      const std::string& module_path, const DsaLayerStandinConfig& config);
  ~LoadedLayerStandin();  // destroys the stand-in; the module stays loaded (cuBLAS's TLS)

  /// One layer for `rows` rows on `stream`; the CUDA error of the launch.
  cudaError_t Run(void* stream, int rows) const {
    return static_cast<cudaError_t>(run_(handle_, rows, stream));
  }

 private:
  LoadedLayerStandin() = default;
  void* handle_ = nullptr;
  int (*run_)(void*, int, void*) = nullptr;
  void (*destroy_)(void*) = nullptr;
};

/// The directory of the running executable (from /proc/self/exe), with a trailing '/'; "" when
/// it cannot be read.
std::string ExecutableDirectory();

}  // namespace dsa::cuda
