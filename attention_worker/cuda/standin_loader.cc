// Loads the layer stand-in module (see standin_loader.h).
#include "attention_worker/cuda/standin_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <array>

#include "absl/strings/str_cat.h"

namespace dsa::cuda {

absl::StatusOr<std::unique_ptr<LoadedLayerStandin>> LoadedLayerStandin::Load(
    const std::string& module_path, const DsaLayerStandinConfig& config) {
  void* module = dlopen(module_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (module == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(absl::StrCat("cannot load the layer stand-in ", module_path, ": ",
                                            why == nullptr ? "unknown error" : why));
  }
  using Create = int (*)(const DsaLayerStandinConfig*, void**, char*, size_t);
  auto create = reinterpret_cast<Create>(dlsym(module, "DsaLayerStandinCreate"));
  auto run = reinterpret_cast<int (*)(void*, int, void*)>(dlsym(module, "DsaLayerStandinRun"));
  auto destroy = reinterpret_cast<void (*)(void*)>(dlsym(module, "DsaLayerStandinDestroy"));
  if (create == nullptr || run == nullptr || destroy == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(module_path, " lacks the layer stand-in's entry points (DsaLayerStandin*)"));
  }
  std::array<char, 512> error{};
  void* handle = nullptr;
  if (const int code = create(&config, &handle, error.data(), error.size()); code != 0) {
    const std::string message =
        absl::StrCat("layer stand-in on GPU ", config.device, ": ", error.data());
    return code == static_cast<int>(cudaErrorMemoryAllocation)
               ? absl::ResourceExhaustedError(message)
               : absl::InternalError(message);
  }
  std::unique_ptr<LoadedLayerStandin> loaded(new LoadedLayerStandin());
  loaded->handle_ = handle;
  loaded->run_ = run;
  loaded->destroy_ = destroy;
  return loaded;
}

LoadedLayerStandin::~LoadedLayerStandin() {
  if (handle_ != nullptr) destroy_(handle_);
}

std::string ExecutableDirectory() {
  std::array<char, 4096> path{};
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) return "";
  const std::string exe(path.data(), static_cast<size_t>(n));
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "" : exe.substr(0, slash + 1);
}

}  // namespace dsa::cuda
