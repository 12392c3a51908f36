// The layer stand-in's C ABI (see standin_module.h).
#include "attention_worker/cuda/standin_module.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <new>

#include "attention_worker/cuda/layer_standin.h"

namespace {

struct StandinState {
  dsa::cuda::LayerStandin standin;
  __nv_bfloat16* activations = nullptr;  // bf16 [max_rows, hidden_dim], zeros
  __nv_bfloat16* out = nullptr;          // bf16 [max_rows, N]
  int device = 0;
};

void Free(StandinState* state) {
  (void)cudaSetDevice(state->device);
  (void)dsa::cuda::DestroyLayerStandin(&state->standin);
  if (state->activations != nullptr) (void)cudaFree(state->activations);
  if (state->out != nullptr) (void)cudaFree(state->out);
  delete state;
}

}  // namespace

extern "C" int DsaLayerStandinCreate(const DsaLayerStandinConfig* config, void** handle,
                                     char* error, size_t error_size) {
  auto fail = [&](cudaError_t code, const char* what, StandinState* state) {
    if (error != nullptr && error_size > 0) {
      std::snprintf(error, error_size, "%s: %s", what, cudaGetErrorString(code));
    }
    if (state != nullptr) Free(state);
    return static_cast<int>(code);
  };
  dsa::cuda::LayerStandinParams params;
  if (config->weight_bytes_per_layer > 0)
    params.weight_bytes_per_layer = config->weight_bytes_per_layer;
  if (config->busy_micros >= 0) params.busy_micros = config->busy_micros;
  params.max_rows = config->max_rows;
  params.seed = config->seed;
  auto* state = new (std::nothrow) StandinState;
  if (state == nullptr) return fail(cudaErrorMemoryAllocation, "the stand-in's state", nullptr);
  state->device = config->device;
  cudaError_t code = cudaSetDevice(config->device);
  if (code != cudaSuccess) return fail(code, "cudaSetDevice", state);
  code = dsa::cuda::CreateLayerStandin(params, &state->standin);
  if (code != cudaSuccess) return fail(code, "the stand-in's weights or cuBLAS", state);
  const size_t activation_bytes =
      sizeof(__nv_bfloat16) * static_cast<size_t>(params.max_rows) * params.hidden_dim;
  code = cudaMalloc(reinterpret_cast<void**>(&state->activations), activation_bytes);
  if (code == cudaSuccess) code = cudaMemset(state->activations, 0, activation_bytes);
  if (code == cudaSuccess) {
    code = cudaMalloc(reinterpret_cast<void**>(&state->out),
                      sizeof(__nv_bfloat16) * static_cast<size_t>(params.max_rows) *
                          static_cast<size_t>(state->standin.weight_rows));
  }
  if (code != cudaSuccess) return fail(code, "the stand-in's activations", state);
  *handle = state;
  return 0;
}

extern "C" int DsaLayerStandinRun(void* handle, int rows, void* stream) {
  auto* state = static_cast<StandinState*>(handle);
  return static_cast<int>(dsa::cuda::RunLayerStandin(
      &state->standin, state->activations, rows, state->out, static_cast<cudaStream_t>(stream)));
}

extern "C" void DsaLayerStandinDestroy(void* handle) {
  if (handle != nullptr) Free(static_cast<StandinState*>(handle));
}
