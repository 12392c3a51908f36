// pybind11 module over probe_entry.cu. Written for this benchmark, not part of SGLang.
#include <torch/extension.h>

#include "tensor_desc.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "get_max_active_clusters",
      [](uint32_t cluster_size, uint32_t occupancy) {
        std::string error;
        const int64_t n = sglang_max_active_clusters(cluster_size, occupancy, &error);
        if (n < 0) throw std::runtime_error(error);
        return n;
      },
      "cudaOccupancyMaxActiveClusters for SGLang's probe kernel (cluster_probe.cuh)");
}
