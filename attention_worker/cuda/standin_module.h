// The layer stand-in (layer_standin.h) behind a C ABI, built as a module of its own
// (libdsa_layer_standin.so) that dsa-attention loads with dlopen once its /metrics server runs:
// cuBLAS, linked into the server, would put libcublasLt's 94 KB of TLS into every thread's static
// TLS block, which does not fit the 100 KB stacks of Debian civetweb's threads; loaded later, its
// TLS (the general-dynamic model) is allocated on first use instead. standin_loader.h loads it.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

/// What DsaLayerStandinCreate builds (a negative or zero field: the stand-in's calibrated
/// default, layer_standin.h).
struct DsaLayerStandinConfig {
  int device;                      // CUDA ordinal of the attention GPU
  int64_t weight_bytes_per_layer;  // <= 0: kStandinDefaultWeightBytes (76.0 MB)
  double busy_micros;              // < 0: kStandinDefaultBusyMicros (84 us)
  int max_rows;                    // rows a layer may run (>= 1)
  uint64_t seed;
};

/// Creates the stand-in (its weights, activations, outputs and cuBLAS handle) on config->device.
/// Returns 0, or a cudaError_t value with a message in `error` (error_size bytes, terminated).
int DsaLayerStandinCreate(const DsaLayerStandinConfig* config, void** handle, char* error,
                          size_t error_size);
/// One layer on `stream` (a cudaStream_t) for `rows` rows (1 .. max_rows): the GEMM over the next
/// weight buffer, then the busy spin. Returns a cudaError_t value (0: enqueued).
int DsaLayerStandinRun(void* handle, int rows, void* stream);
/// Frees everything DsaLayerStandinCreate made.
void DsaLayerStandinDestroy(void* handle);
}
