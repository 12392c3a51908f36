// The flags that configure an indexer engine and where it scores (CPU, or a GPU through the CUDA
// scoring device), shared by `dsa-indexer` and by `dsa-attention --transport inprocess`, which
// holds an indexer of its own.
#pragma once

#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "indexer_service/indexer.h"

namespace dsa {

/// Values of the indexer flags (defaults as dsa-indexer documents them).
struct IndexerFlags {
  IndexerOptions options;
  std::string device = "cpu";  // cpu | cuda
  int cuda_device = 0;
  std::string scan_kernel = "auto";  // auto | tensor-cores | cuda-cores
  bool gpu_spin = true;
  CLI::App* app = nullptr;  // the app they were added to (to tell flags given from defaults)
  std::string prefix;       // their name prefix ("--" or "--indexer-")
};

/// Registers --<p>capacity-blocks, --<p>audit-fraction, --<p>audit-seed, --<p>device,
/// --<p>cuda-device, --<p>scan-kernel, --<p>gpu-spin on `app` (p = `prefix` without the leading
/// "--", e.g. "--indexer-" gives --indexer-device), and --num-heads / --head-dim when
/// `with_shape_flags` (a host that sets H and D elsewhere passes false). `flags` must outlive the
/// parse.
void AddIndexerFlags(CLI::App& app, IndexerFlags& flags, const std::string& prefix,
                     bool with_shape_flags);

/// The indexer the parsed flags describe: on the CPU, or with device cuda a CudaScoringDevice on
/// GPU cuda_device (a GPU failure later falls back to the CPU; it is logged). Errors:
/// INVALID_ARGUMENT (a GPU flag without device cuda, an unknown scan kernel),
/// FAILED_PRECONDITION (device cuda in a build without CUDA), the device's and
/// Indexer::Create's errors (a GPU that is absent, a shape the kernels cannot run).
absl::StatusOr<std::unique_ptr<Indexer>> CreateIndexerFromFlags(const IndexerFlags& flags);

}  // namespace dsa
