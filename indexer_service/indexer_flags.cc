// The indexer's flags and the engine they describe (see indexer_flags.h).
#include "indexer_service/indexer_flags.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/server.h"
#ifdef DSA_WITH_CUDA
#include "indexer_service/cuda/cuda_scoring_device.h"
#endif

namespace dsa {

void AddIndexerFlags(CLI::App& app, IndexerFlags& flags, const std::string& prefix,
                     bool with_shape_flags) {
  flags.app = &app;
  flags.prefix = prefix;
  app.add_option(prefix + "capacity-blocks", flags.options.capacity_blocks,
                 "Index-key cache size in 64-slot blocks, shared by all sequences and layers")
      ->check(CLI::Validator(
          [](const std::string& value) {
            // CLI11's PositiveNumber would print its range as a 300-digit number.
            std::int64_t blocks = 0;
            return CLI::detail::lexical_cast(value, blocks) && blocks >= 1
                       ? std::string()
                       : "must be a whole number of blocks, at least 1; got " + value;
          },
          "BLOCKS >= 1"))
      ->capture_default_str();
  if (with_shape_flags) {
    app.add_option("--num-heads", flags.options.num_heads, "Indexer query heads H")
        ->capture_default_str();
    app.add_option("--head-dim", flags.options.head_dim, "Index-key and query dimension D")
        ->capture_default_str();
  }
  app.add_option(
         prefix + "audit-fraction", flags.options.audit_fraction,
         "Fraction of pruned selects re-scored densely to export dsa_indexer_audited_miss_ratio")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option(prefix + "audit-seed", flags.options.audit_seed, "Seed of the audit draws")
      ->capture_default_str();
  app.add_option(prefix + "miss-target", flags.options.miss_target,
                 "Adaptive sparsity: hold each sequence's audited miss rate near this target by "
                 "moving its SPIN rho (0: rho fixed, the default); for sequences whose settings "
                 "name no target; needs " +
                     prefix + "audit-fraction > 0")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_option(prefix + "device", flags.device,
                 "Where scan and top-K run: cpu, or cuda (a GPU mirrors the index-key cache; the "
                 "host copy stays, so a GPU failure falls back to the CPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option(prefix + "cuda-device", flags.cuda_device,
                 "CUDA ordinal of the GPU (" + prefix + "device cuda)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option(prefix + "scan-kernel", flags.scan_kernel,
                 "GPU scan: auto (tensor cores where H is 16/32/64 and D 64/128), tensor-cores "
                 "(bf16 queries) or cuda-cores (fp32 queries)")
      ->check(CLI::IsMember({"auto", "tensor-cores", "cuda-cores"}))
      ->capture_default_str();
  app.add_option(prefix + "gpu-spin", flags.gpu_spin,
                 prefix +
                     "device cuda: run SPIN on the GPU too (V and D resident there) where "
                     "the sequence's settings allow; false plans on the CPU")
      ->capture_default_str();
}

absl::StatusOr<std::unique_ptr<Indexer>> CreateIndexerFromFlags(const IndexerFlags& flags) {
  if (flags.device == "cpu" && flags.app != nullptr) {
    for (const char* gpu_flag : {"cuda-device", "scan-kernel", "gpu-spin"}) {
      const std::string name = flags.prefix + gpu_flag;
      if (flags.app->count(name) > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, " is a GPU flag: it needs ", flags.prefix, "device cuda"));
      }
    }
  }
  std::unique_ptr<ScoringDevice> scoring_device;
  if (flags.device == "cuda") {
#ifdef DSA_WITH_CUDA
    cuda::CudaScoringOptions cuda_options;
    cuda_options.device = flags.cuda_device;
    cuda_options.spin = flags.gpu_spin;
    if (absl::Status s = cuda::ParseScanKernel(flags.scan_kernel, &cuda_options.scan_kernel);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(flags.prefix, "scan-kernel: ", s.message()));
    }
    auto created = cuda::CreateCudaScoringDevice(cuda_options);
    if (!created.ok()) {
      return absl::Status(created.status().code(),
                          absl::StrCat("cannot use the GPU: ", created.status().message()));
    }
    scoring_device = std::move(*created);
#else
    return absl::FailedPreconditionError(
        absl::StrCat(flags.prefix,
                     "device cuda: this binary was built without CUDA (configure "
                     "with -DDSA_ENABLE_CUDA=ON where nvcc is installed)"));
#endif
  }
  return Indexer::Create(flags.options, std::move(scoring_device), [](const absl::Status& status) {
    LogJson("error", "the GPU failed; scoring on the CPU from now on",
            {{"status", status.ToString()}});
  });
}

}  // namespace dsa
