// SGLang's cluster occupancy probe (csrc/occupancy/cluster_probe.cuh, unchanged), which
// sglang.kernels.jit.utils.occupancy.get_max_active_clusters compiles and calls before it
// compiles top-k v2; here a module of its own for the same reason. Written for this benchmark.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <exception>
#include <string>

#include "csrc/occupancy/cluster_probe.cuh"
#include "tensor_desc.h"

int64_t sglang_max_active_clusters(uint32_t cluster_size, uint32_t occupancy, std::string* error) {
  try {
    return static_cast<int64_t>(sglang::get_max_active_clusters(cluster_size, occupancy));
  } catch (const std::exception& e) {
    if (error != nullptr) *error = e.what();
  } catch (...) {
    if (error != nullptr) *error = "unknown exception";
  }
  return -1;
}
