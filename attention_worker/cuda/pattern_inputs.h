// The pattern model's indexer inputs generated on the GPU: index keys (with
// the shared-prefix-block rule of SequenceIndexKeys) and indexer queries, bit-identical to
// PatternModel::IndexKeys / PrefixBlockIndexKeys / IndexerQuery (attention_worker/pattern_model.h)
// for the same seed. The per-model tables come from PatternModel::Tables() and
// BoxMullerFirstNormalTables(); no transcendental function of the CPU model is evaluated on the
// device except the rotations, which go through rotation_cos_sin.h. Head weights are not generated
// here (they need glibc's expf): take them from PatternModel::HeadWeights.
// Framework-free: raw pointers, sizes, a stream, a cudaError_t back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attention_worker/pattern_tables.h"

namespace dsa::cuda {

/// The pattern model's tables on the device (one allocation, owned by whoever called
/// UploadPatternTables; FreePatternTables releases it). Shapes as PatternTables; all device
/// pointers, read-only.
struct PatternDeviceTables {
  PatternScalars scalars;
  const double* rope_theta = nullptr;          // [D/4]
  const int32_t* diagonal_offsets = nullptr;   // [num_diagonals]
  const float* diagonal_spectra = nullptr;     // [num_diagonals, D/4]
  const float* topic_directions = nullptr;     // [L, num_topics, D/2]
  const float* sink_direction = nullptr;       // [L, D/2]
  const float* salient_direction = nullptr;    // [L, D/2]
  const float* common_direction = nullptr;     // [L, D/2]
  const float* rope_base = nullptr;            // [L, D/2]
  const float* key_noise_pool = nullptr;       // [L, 1024, D]
  const float* query_noise_pool = nullptr;     // [L, 1024, D/2]
  const uint32_t* layer_lattice = nullptr;     // [L]
  const double* layer_smoothstep = nullptr;    // [L]
  const double* layer_lattice_norm = nullptr;  // [L]
  const float* box_muller_radius = nullptr;    // [2^24] (BoxMullerFirstNormalTables)
  const float* box_muller_cosine = nullptr;    // [2^24]
  void* allocation = nullptr;                  // the one device allocation behind the pointers
  size_t allocation_bytes = 0;
};

/// Copies `tables` and the two Box-Muller tables (host arrays of kBoxMullerTableSize floats each)
/// to the current device, synchronously, into one allocation of about 128 MiB + 0.8 MB per layer.
/// On error nothing stays allocated and *out is unchanged. cudaErrorInvalidValue when a table's
/// size does not match its scalars.
cudaError_t UploadPatternTables(const PatternTables& tables, const float* box_muller_radius,
                                const float* box_muller_cosine, PatternDeviceTables* out);
/// Frees the allocation of UploadPatternTables and clears *tables (no-op when already clear).
cudaError_t FreePatternTables(PatternDeviceTables* tables);

/// One launch of index keys for one full layer. Two modes:
/// - range (slots == nullptr): key j is slot first_slot + j of one sequence whose prompt has
///   prefix_block_ids: slot i < 512 * num_prefix_ids takes offset i % 512 of prefix block
///   prefix_block_ids[i / 512] (PrefixBlockIndexKeys), other slots are slot-indexed (IndexKeys);
///   exactly SequenceIndexKeys (attention_worker/model_inputs.h).
/// - gather (slots != nullptr): key j is slot slots[j] with content prefix block
///   key_prefix_block_ids[j] at offset key_prefix_offsets[j], or slot-indexed content where
///   key_prefix_offsets[j] < 0 (so one launch serves many sequences).
struct PatternIndexKeysParams {
  PatternDeviceTables tables;
  /// Full layer in [0, L).
  int layer = 0;
  /// Keys written (>= 0; 0 launches nothing).
  int64_t num_keys = 0;
  // Range mode.
  /// First slot (>= 0).
  int64_t first_slot = 0;
  /// Device uint64 [num_prefix_ids] (may be null when num_prefix_ids == 0).
  const uint64_t* prefix_block_ids = nullptr;
  int64_t num_prefix_ids = 0;
  // Gather mode.
  /// Device int64 [num_keys]: absolute slot of key j (>= 0), or null for the range mode.
  const int64_t* slots = nullptr;
  /// Device uint64 [num_keys]: prefix block id of key j's content (read where the offset >= 0).
  const uint64_t* key_prefix_block_ids = nullptr;
  /// Device int32 [num_keys]: offset in [0, 512) of key j in its prefix block, or < 0 for
  /// slot-indexed content.
  const int32_t* key_prefix_offsets = nullptr;
  /// Device fp32 out [num_keys, D], row-major.
  float* keys = nullptr;
};

/// One launch of indexer queries: row r is (layers[r], positions[r]); its query is
/// PatternModel::IndexerQuery's query_out, fp32 [H, D].
struct PatternIndexerQueriesParams {
  PatternDeviceTables tables;
  /// Rows (>= 0; 0 launches nothing).
  int num_rows = 0;
  /// Device int32 [num_rows]: full layer of each row, in [0, L).
  const int32_t* layers = nullptr;
  /// Device int64 [num_rows]: query position t of each row, >= 0 (any value below 2^62).
  const int64_t* positions = nullptr;
  /// Device fp32 out [num_rows, H, D], row-major.
  float* queries = nullptr;
};

/// Whether the launch is supported (tables uploaded, sizes, layer range); on false, *why (when not
/// null) names the reason (a static string). Device-side values (slots, layers, positions,
/// offsets) are not checked: out-of-range values there give unspecified keys, never a fault
/// outside the tables, except a layer outside [0, L), which must not be passed.
bool CanImplementPatternIndexKeys(const PatternIndexKeysParams& params, const char** why = nullptr);
bool CanImplementPatternIndexerQueries(const PatternIndexerQueriesParams& params,
                                       const char** why = nullptr);

/// Writes the keys on `stream` (asynchronous; one warp per key). cudaErrorInvalidValue when
/// CanImplementPatternIndexKeys fails, else the launch error.
cudaError_t LaunchPatternIndexKeys(const PatternIndexKeysParams& params, cudaStream_t stream);
/// Writes the queries on `stream` (asynchronous; one warp per (row, head)).
/// cudaErrorInvalidValue when CanImplementPatternIndexerQueries fails, else the launch error.
cudaError_t LaunchPatternIndexerQueries(const PatternIndexerQueriesParams& params,
                                        cudaStream_t stream);

}  // namespace dsa::cuda
