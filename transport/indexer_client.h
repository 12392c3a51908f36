// The attention worker's view of one indexer worker: the control plane (shape, sequences, index-key
// appends, speculative commits) and the data plane (SelectionTransport), behind one interface so
// the attention engine runs the same against a remote indexer (gRPC), one in its own process, and
// a fake in tests. A factory per address makes them; the engine injects it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "contracts/lease.h"
#include "contracts/sequence.h"
#include "transport/selection_transport.h"

namespace dsa {

/// A sequence to create on the indexer (Indexer::CreateSequence / CreateSequenceFromPrefix).
struct IndexerSequenceSpec {
  uint64_t sequence_id = 0;
  /// Full layers, top-K and SPIN settings of the sequence.
  SequenceOptions options;
  /// With a value: share the first prefix_slots slots (a multiple of 64) of that sequence.
  std::optional<uint64_t> prefix_source_id;
  int64_t prefix_slots = 0;
  /// The coordinator's lease the sequence is held under on the indexer (empty: none). An
  /// in-process indexer has no lease table of its own: the co-located service attaches there
  /// (AttentionServiceImpl::ShareIndexerWith).
  SequenceLease lease;
};

/// One append call to one sequence: chunks of index keys in order, all or nothing (a failed or
/// cancelled call removes every key it appended). Not thread-safe; one per sequence at a time.
class IndexKeyAppend {
 public:
  virtual ~IndexKeyAppend() = default;
  /// Appends keys fp32 [num_keys, D] to full layer `layer` at `first_slot` (the layer's slot
  /// count). Returns false when the call has ended (Finish says why); then no later chunk is taken.
  virtual bool Write(int layer, int64_t first_slot, std::span<const float> keys,
                     int64_t num_keys) = 0;
  /// Ends the call; the number of keys appended over all chunks, or the error that ended it
  /// (every chunk of the call undone): the indexer's INVALID_ARGUMENT, NOT_FOUND,
  /// FAILED_PRECONDITION, RESOURCE_EXHAUSTED, or UNAVAILABLE / DEADLINE_EXCEEDED.
  virtual absl::StatusOr<int64_t> Finish() = 0;
  /// Abandons the call: every chunk it appended is undone. Finish must not be called after.
  virtual void Cancel() = 0;
};

/// Thread-safe: any thread may call any method.
class IndexerClient {
 public:
  virtual ~IndexerClient() = default;
  /// The indexer worker's address (host:port), or a name for one in process; used in messages.
  virtual const std::string& address() const = 0;
  /// The indexer's H and D. UNAVAILABLE / DEADLINE_EXCEEDED when it cannot be reached.
  virtual absl::StatusOr<IndexerShape> GetShape(absl::Time deadline) = 0;
  /// Indexer::CreateSequence (or ...FromPrefix) errors, or UNAVAILABLE / DEADLINE_EXCEEDED (then
  /// the sequence may or may not exist on the indexer).
  virtual absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time deadline) = 0;
  /// Starts an append call to `sequence_id` (see IndexKeyAppend). `deadline` bounds the whole call.
  virtual std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t sequence_id,
                                                      absl::Time deadline) = 0;
  /// Indexer::BeginTurn, Commit and Release, with the transport's UNAVAILABLE / DEADLINE_EXCEEDED.
  virtual absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) = 0;
  virtual absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) = 0;
  virtual absl::Status Release(uint64_t sequence_id, absl::Time deadline) = 0;
  /// The data plane to this indexer (the same object for the client's lifetime).
  virtual SelectionTransport& Selections() = 0;
  /// Closes the data plane (SelectionTransport::Close). Idempotent.
  virtual absl::Status Close() = 0;
  /// True when the data plane was made and its connection has ended (SelectionTransport::ended):
  /// the client cannot serve selects any more and should be replaced. Never makes the data plane.
  virtual bool DataPlaneEnded() const { return false; }
};

/// Makes the client of the indexer worker at `address` (an address the coordinator named in a
/// Prefill). INVALID_ARGUMENT for an address this factory cannot serve (e.g. an in-process
/// factory asked for another indexer).
using IndexerClientFactory =
    std::function<absl::StatusOr<std::shared_ptr<IndexerClient>>(const std::string& address)>;

}  // namespace dsa
