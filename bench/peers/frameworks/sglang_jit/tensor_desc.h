// A tensor as the binding (bind.cpp, torch) hands it to entry.cu (SGLang's tvm-ffi side): the
// two translation units share no header but this one, so torch's and tvm-ffi's DLPack headers
// never meet. Written for this benchmark, not part of SGLang.
#pragma once
#include <cstdint>
#include <string>

struct TensorDesc {
  void* data = nullptr;
  int32_t device_id = 0;
  int32_t ndim = 0;
  int64_t shape[2] = {0, 0};
  int64_t strides[2] = {0, 0};
  uint8_t dtype_code = 0;  // DLDataTypeCode: 0 int, 1 uint, 2 float
  uint8_t dtype_bits = 0;
};

// Each returns "" or the error message of the exception the launch code threw.
std::string sglang_topk_v2_plan(const TensorDesc& seq_lens, const TensorDesc& metadata,
                                int32_t static_threshold, void* stream);
std::string sglang_topk_v2_transform_paged(const TensorDesc& scores, const TensorDesc& seq_lens,
                                           const TensorDesc* page_table,
                                           const TensorDesc& page_indices, uint32_t page_size,
                                           const TensorDesc& metadata, void* stream);
// The occupancy probe (csrc/occupancy/cluster_probe.cuh, probe_entry.cu, a module of its own);
// -1 and the message on an error.
int64_t sglang_max_active_clusters(uint32_t cluster_size, uint32_t occupancy, std::string* error);
// What the module was compiled with (the probe's results, or the header defaults).
std::string sglang_build_info();
