// Registers vLLM's DSA-indexer top-K ops (csrc/ here, unchanged from vLLM 0.34.0) as
// torch.ops.vllm_peer.<name>, the way vLLM's csrc/torch_bindings.cpp registers them under _C:
// the same schemas, the same stable-ABI functions, boxed with TORCH_BOX. Not a Python module:
// torch.utils.cpp_extension.load(..., is_python_module=False) loads it and the ops appear.
#include <torch/csrc/stable/library.h>

#include "csrc/ops.h"

STABLE_TORCH_LIBRARY(vllm_peer, ops) {
  // Schemas copied from vLLM's csrc/torch_bindings.cpp.
  ops.def(
      "top_k_per_row_prefill(Tensor logits, Tensor rowStarts, Tensor rowEnds, "
      "Tensor! indices, int numRows, int stride0, "
      "int stride1, int topK) -> ()");
  ops.def(
      "top_k_per_row_decode(Tensor logits, int next_n, "
      "Tensor seq_lens, Tensor! indices, "
      "int numRows, int stride0, int stride1, int topK) -> ()");
  ops.def(
      "persistent_topk(Tensor logits, Tensor lengths, Tensor! output, "
      "Tensor workspace, int k, int max_seq_len) -> ()");
#ifdef VLLM_ENABLE_COOPERATIVE_TOPK
  ops.def(
      "cooperative_topk(Tensor logits, Tensor lengths, Tensor! output, "
      "Tensor workspace, int k, int max_seq_len) -> ()");
#endif
}

STABLE_TORCH_LIBRARY_IMPL(vllm_peer, CUDA, ops) {
  ops.impl("top_k_per_row_prefill", TORCH_BOX(&top_k_per_row_prefill));
  ops.impl("top_k_per_row_decode", TORCH_BOX(&top_k_per_row_decode));
  ops.impl("persistent_topk", TORCH_BOX(&persistent_topk));
#ifdef VLLM_ENABLE_COOPERATIVE_TOPK
  ops.impl("cooperative_topk", TORCH_BOX(&cooperative_topk));
#endif
}
