// What a sequence is created with on an indexer worker, and the indexer's shape that the attention
// worker must match (DESIGN.md 4.1-4.2): the plain types the coordinator, the attention worker and
// the indexer engine share.
#pragma once

#include "contracts/spin_config.h"

namespace dsa {

/// What the attention worker must agree on with its indexer worker.
struct IndexerShape {
  int num_heads = 0;  // H of the indexer query
  int head_dim = 0;   // D of index keys and queries
};

/// Per-sequence settings.
struct SequenceOptions {
  int num_layers = 1;  // full layers with an indexer (index-key cache and SPIN state each)
  int top_k = 2048;    // K, in [1, kMaxTopK]
  /// SPIN settings; the exploration draws use MixSeed(spin.seed, sequence id), so sequences with
  /// the same configured seed still draw independently, and a rerun with the same ids repeats.
  SpinConfig spin;
};

}  // namespace dsa
