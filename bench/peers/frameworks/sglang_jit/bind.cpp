// pybind11 module over entry.cu: takes torch tensors, hands them to SGLang's top-k v2 launch code
// as tvm-ffi would (entry.cu), on torch's current stream. Calls as
// sglang.kernels.ops.attention.dsv4.topk.plan_topk_v2 / topk_transform_paged_v2 call the
// module. Written for this benchmark, not part of SGLang.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <stdexcept>

#include "tensor_desc.h"

namespace {

TensorDesc describe(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() >= 1 && t.dim() <= 2, name, " must be 1-D or 2-D");
  TensorDesc d;
  d.data = t.data_ptr();
  d.device_id = t.get_device();
  d.ndim = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    d.shape[i] = t.size(i);
    d.strides[i] = t.stride(i);
  }
  switch (t.scalar_type()) {
    case at::kFloat:
      d.dtype_code = 2;
      d.dtype_bits = 32;
      break;
    case at::kInt:
      d.dtype_code = 0;
      d.dtype_bits = 32;
      break;
    case at::kLong:
      d.dtype_code = 0;
      d.dtype_bits = 64;
      break;
    case at::kByte:
      d.dtype_code = 1;
      d.dtype_bits = 8;
      break;
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", t.scalar_type());
  }
  return d;
}

void* stream_of(const at::Tensor& t) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
}

void check(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "topk_plan",
      [](const at::Tensor& seq_lens, const at::Tensor& metadata, int32_t static_threshold) {
        check(sglang_topk_v2_plan(describe(seq_lens, "seq_lens"), describe(metadata, "metadata"),
                                  static_threshold, stream_of(seq_lens)));
      },
      "TopKKernel<pdl>::plan (plan_topk_v2)");
  m.def(
      "topk_transform_paged",
      [](const at::Tensor& scores, const at::Tensor& seq_lens, std::optional<at::Tensor> page_table,
         const at::Tensor& page_indices, uint32_t page_size, const at::Tensor& metadata) {
        std::optional<TensorDesc> pt;
        if (page_table.has_value()) pt = describe(*page_table, "page_table");
        check(sglang_topk_v2_transform_paged(
            describe(scores, "scores"), describe(seq_lens, "seq_lens"),
            pt.has_value() ? &*pt : nullptr, describe(page_indices, "page_indices"), page_size,
            describe(metadata, "metadata"), stream_of(scores)));
      },
      "TopKKernel<pdl>::transform_paged (topk_transform_paged_v2), no raw_indices");
  m.def("build_info", &sglang_build_info);
}
