// IndexerClient for an indexer engine in the attention worker's own process (co-located): the
// control plane calls the Indexer directly, the data plane is an InProcessSelectionTransport.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "transport/in_process_transport.h"
#include "transport/indexer_client.h"

namespace dsa {

/// The address an attention worker's Prefill names for its co-located indexer.
inline constexpr char kInProcessIndexerAddress[] = "in-process";

/// Thread-safe. Errors are the engine's, unchanged (the message prefixed with the call's name, as
/// the gRPC client prefixes the address). Deadlines are not needed in process and are ignored.
class InProcessIndexerClient final : public IndexerClient {
 public:
  /// `indexer` (and `metrics`, optional) must outlive the client.
  explicit InProcessIndexerClient(Indexer* indexer, IndexerMetrics* metrics = nullptr);
  ~InProcessIndexerClient() override;  // Close()s

  const std::string& address() const override { return address_; }
  absl::StatusOr<IndexerShape> GetShape(absl::Time deadline) override;
  absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time deadline) override;
  std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) override;
  absl::Status Release(uint64_t sequence_id, absl::Time deadline) override;
  SelectionTransport& Selections() override { return transport_; }
  absl::Status Close() override { return transport_.Close(); }

  /// A factory that serves kInProcessIndexerAddress, and every address `is_own_address` accepts
  /// (e.g. the attention worker's own gRPC address, where it also serves its indexer to the
  /// coordinator), with one shared client of `indexer`; any other address is INVALID_ARGUMENT
  /// (a co-located attention worker dials no remote indexer). The client is the same for the
  /// factory's lifetime (the engine's drop-and-remake after UNAVAILABLE gets it back; it is
  /// closed only when the engine shuts down).
  static IndexerClientFactory Factory(
      Indexer* indexer, IndexerMetrics* metrics = nullptr,
      std::function<bool(const std::string&)> is_own_address = nullptr);

 private:
  void UpdateCacheMetrics();

  const std::string address_ = kInProcessIndexerAddress;
  Indexer* const indexer_;
  IndexerMetrics* const metrics_;
  InProcessSelectionTransport transport_;
};

}  // namespace dsa
