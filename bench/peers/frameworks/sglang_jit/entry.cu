// The host side of SGLang's top-k v2 (csrc/deepseek_v4/topk_v2.cuh, unchanged), called as the
// wrappers that SGLang's load_jit generates call it (TVM_FFI_DLL_EXPORT_TYPED_FUNC(
// topk_transform_paged, TopKKernel<true>::transform_paged) and topk_plan ...::plan), from a
// tensor description instead of a tvm-ffi call: each tensor becomes the DLTensor tvm-ffi would
// have passed, the stream tvm-ffi would have set (TVMFFIEnvSetStream: torch's current stream) is
// set around the call. Compiled as SGLang compiles it: -std=c++20 -O3 --expt-relaxed-constexpr
// -DSGL_CUDA_ARCH=900, PDL on (is_arch_support_pdl() on sm_90), and the cluster counts its
// occupancy probe measured as -DSGL_TOPK_V2_MAX_C8_OCC2 / -DSGL_TOPK_V2_MAX_C16_OCC1.
// Written for this benchmark, not part of SGLang.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <exception>
#include <optional>
#include <string>

#include "csrc/deepseek_v4/topk_v2.cuh"
#include "tensor_desc.h"

namespace {

struct Dl {
  DLTensor t{};
  int64_t shape[2] = {0, 0};
  int64_t strides[2] = {0, 0};
  explicit Dl(const TensorDesc& d) {
    for (int i = 0; i < d.ndim && i < 2; ++i) {
      shape[i] = d.shape[i];
      strides[i] = d.strides[i];
    }
    t.data = d.data;
    t.device = DLDevice{kDLCUDA, d.device_id};
    t.ndim = d.ndim;
    t.dtype = DLDataType{d.dtype_code, d.dtype_bits, 1};
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = 0;
  }
  tvm::ffi::TensorView view() const { return tvm::ffi::TensorView(&t); }
};

// tvm-ffi's "current stream" of the device, as its torch integration sets it for a call.
struct StreamScope {
  int32_t device_id;
  TVMFFIStreamHandle previous = nullptr;
  StreamScope(int32_t device, void* stream) : device_id(device) {
    TVMFFIEnvSetStream(kDLCUDA, device_id, stream, &previous);
  }
  ~StreamScope() { TVMFFIEnvSetStream(kDLCUDA, device_id, previous, nullptr); }
};

template <typename F>
std::string guarded(F&& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    std::string what = e.what();
    return what.empty() ? std::string("exception") : what;
  } catch (...) {
    return "unknown exception";
  }
}

constexpr bool kUsePDL = SGL_ARCH_HOPPER_OR_GREATER;  // is_arch_support_pdl(): major >= 9

}  // namespace

std::string sglang_topk_v2_plan(const TensorDesc& seq_lens, const TensorDesc& metadata,
                                int32_t static_threshold, void* stream) {
  return guarded([&] {
    StreamScope scope(seq_lens.device_id, stream);
    const Dl s(seq_lens), m(metadata);
    sglang::TopKKernel<kUsePDL>::plan(s.view(), m.view(), static_threshold);
  });
}

std::string sglang_topk_v2_transform_paged(const TensorDesc& scores, const TensorDesc& seq_lens,
                                           const TensorDesc* page_table,
                                           const TensorDesc& page_indices, uint32_t page_size,
                                           const TensorDesc& metadata, void* stream) {
  return guarded([&] {
    StreamScope scope(scores.device_id, stream);
    const Dl sc(scores), sl(seq_lens), out(page_indices), md(metadata);
    std::optional<Dl> pt;
    tvm::ffi::Optional<tvm::ffi::TensorView> page_table_view;
    if (page_table != nullptr) {
      pt.emplace(*page_table);
      page_table_view = pt->view();
    }
    sglang::TopKKernel<kUsePDL>::transform_paged(sc.view(), sl.view(), page_table_view, out.view(),
                                                 page_size, md.view(),
                                                 tvm::ffi::Optional<tvm::ffi::TensorView>());
  });
}

#define SGLANG_STR2(x) #x
#define SGLANG_STR(x) SGLANG_STR2(x)
std::string sglang_build_info() {
  std::string info = "SGL_CUDA_ARCH=" SGLANG_STR(SGL_CUDA_ARCH);
#if SUPPORT_CLUSTER
  info += " SGL_TOPK_V2_MAX_C8_OCC2=" + std::to_string(sglang::kNumPersistentClusters);
  info += " SGL_TOPK_V2_MAX_C16_OCC1=" + std::to_string(sglang::kMaxCluster16BatchSize);
#endif
  info += kUsePDL ? " PDL on" : " PDL off";
  return info;
}
