// cuBLAS loaded at run time (see cublas_library.h).
#include "attention_worker/cuda/cublas_library.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

namespace dsa::cuda {

const CublasApi* LoadCublas(std::string* error) {
  static std::once_flag once;
  static CublasApi api;
  static bool loaded = false;
  static std::string load_error;
  std::call_once(once, [] {
    void* module = nullptr;
    for (const char* name :
         {"libcublas.so.13", "libcublas.so", "/usr/local/cuda/lib64/libcublas.so.13"}) {
      module = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (module != nullptr) break;
      const char* why = dlerror();
      load_error = std::string("cannot load cuBLAS (") + name +
                   "): " + (why == nullptr ? "unknown error" : why);
    }
    if (module == nullptr) return;
    const auto find = [&](auto* slot, const char* symbol) {
      *slot = reinterpret_cast<std::remove_reference_t<decltype(*slot)>>(dlsym(module, symbol));
      if (*slot == nullptr && load_error.empty()) {
        load_error = std::string("cuBLAS lacks ") + symbol;
      }
    };
    load_error.clear();
    find(&api.create, "cublasCreate_v2");
    find(&api.destroy, "cublasDestroy_v2");
    find(&api.set_stream, "cublasSetStream_v2");
    find(&api.set_math_mode, "cublasSetMathMode");
    find(&api.sgemm, "cublasSgemm_v2");
    find(&api.status_string, "cublasGetStatusString");
    loaded = load_error.empty();
  });
  if (!loaded && error != nullptr) *error = load_error;
  return loaded ? &api : nullptr;
}

}  // namespace dsa::cuda
