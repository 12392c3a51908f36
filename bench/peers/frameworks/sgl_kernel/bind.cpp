// pybind11 binding of sgl-kernel's DSA top-K (topk.cu here, unchanged from sgl-kernel's
// csrc/elementwise/topk.cu). Each function calls the sgl-kernel host entry point that
// torch.ops.sgl_kernel.<op> dispatches to, with the same arguments (sgl-kernel's
// common_extension.cc registers them as
//   fast_topk(Tensor score, Tensor indices, Tensor lengths, Tensor? row_starts) -> ()
//   fast_topk_transform_fused(Tensor score, Tensor lengths, Tensor dst_page_table,
//                             Tensor src_page_table, Tensor cu_seqlens_q, Tensor? row_starts) -> ()
//   fast_topk_transform_ragged_fused(Tensor score, Tensor lengths, Tensor topk_indices_ragged,
//                                    Tensor topk_indices_offset, Tensor? row_starts) -> ()
// and sgl_kernel/top_k.py's fast_topk_v2 / fast_topk_transform_fused /
// fast_topk_transform_ragged_fused call them).
#include <torch/extension.h>

#include <optional>

void fast_topk_interface(const at::Tensor& score, at::Tensor& indices, const at::Tensor& lengths,
                         std::optional<at::Tensor> row_starts_opt);
void fast_topk_transform_interface(const at::Tensor& score, const at::Tensor& lengths,
                                   at::Tensor& dst_page_table, const at::Tensor& src_page_table,
                                   const at::Tensor& cu_seqlens_q,
                                   std::optional<at::Tensor> row_starts_opt);
void fast_topk_transform_ragged_interface(const at::Tensor& score, const at::Tensor& lengths,
                                          at::Tensor& topk_indices_ragged,
                                          const at::Tensor& topk_indices_offset,
                                          std::optional<at::Tensor> row_starts_opt);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "fast_topk",
      [](const at::Tensor& score, at::Tensor indices, const at::Tensor& lengths,
         std::optional<at::Tensor> row_starts) {
        fast_topk_interface(score, indices, lengths, row_starts);
      },
      "sgl-kernel fast_topk (fast_topk_v2): indices [B, 2048] int32", py::arg("score"),
      py::arg("indices"), py::arg("lengths"), py::arg("row_starts") = py::none());
  m.def(
      "fast_topk_transform_fused",
      [](const at::Tensor& score, const at::Tensor& lengths, at::Tensor dst_page_table,
         const at::Tensor& src_page_table, const at::Tensor& cu_seqlens_q,
         std::optional<at::Tensor> row_starts) {
        fast_topk_transform_interface(score, lengths, dst_page_table, src_page_table, cu_seqlens_q,
                                      row_starts);
      },
      "sgl-kernel fast_topk_transform_fused: top-K fused with the page_size=1 table gather",
      py::arg("score"), py::arg("lengths"), py::arg("dst_page_table"), py::arg("src_page_table"),
      py::arg("cu_seqlens_q"), py::arg("row_starts") = py::none());
  m.def(
      "fast_topk_transform_ragged_fused",
      [](const at::Tensor& score, const at::Tensor& lengths, at::Tensor topk_indices_ragged,
         const at::Tensor& topk_indices_offset, std::optional<at::Tensor> row_starts) {
        fast_topk_transform_ragged_interface(score, lengths, topk_indices_ragged,
                                             topk_indices_offset, row_starts);
      },
      "sgl-kernel fast_topk_transform_ragged_fused", py::arg("score"), py::arg("lengths"),
      py::arg("topk_indices_ragged"), py::arg("topk_indices_offset"),
      py::arg("row_starts") = py::none());
}
