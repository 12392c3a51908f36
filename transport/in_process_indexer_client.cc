// IndexerClient for a co-located indexer engine (see in_process_indexer_client.h).
#include "transport/in_process_indexer_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "indexer_service/index_key_append.h"

namespace dsa {
namespace {

absl::Status Prefixed(const absl::Status& status, absl::string_view call) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("in-process indexer: ", call, ": ", status.message()));
}

// One append call straight into the engine; undone on failure or cancel.
class InProcessIndexKeyAppend final : public IndexKeyAppend {
 public:
  InProcessIndexKeyAppend(Indexer* indexer, uint64_t sequence_id, std::function<void()> on_done)
      : call_(indexer), sequence_id_(sequence_id), on_done_(std::move(on_done)) {}
  ~InProcessIndexKeyAppend() override {
    if (!done_) Cancel();
  }

  bool Write(int layer, int64_t first_slot, std::span<const float> keys,
             int64_t num_keys) override {
    if (!status_.ok()) return false;
    status_ = call_.Append(sequence_id_, layer, first_slot, keys, num_keys,
                           absl::StrCat("chunk ", chunks_++, ": "));
    if (!status_.ok()) call_.Undo();
    return status_.ok();
  }

  absl::StatusOr<int64_t> Finish() override {
    done_ = true;
    const int64_t appended = call_.keys_appended();
    if (on_done_) on_done_();
    if (!status_.ok()) return Prefixed(status_, "AppendIndexKeys");
    return appended;
  }

  void Cancel() override {
    done_ = true;
    call_.Undo();
    if (on_done_) on_done_();
  }

 private:
  IndexKeyAppendCall call_;
  const uint64_t sequence_id_;
  std::function<void()> on_done_;
  absl::Status status_;
  int64_t chunks_ = 0;
  bool done_ = false;
};

}  // namespace

InProcessIndexerClient::InProcessIndexerClient(Indexer* indexer, IndexerMetrics* metrics)
    : indexer_(indexer), metrics_(metrics), transport_(indexer, metrics) {}

InProcessIndexerClient::~InProcessIndexerClient() { (void)Close(); }

void InProcessIndexerClient::UpdateCacheMetrics() {
  if (metrics_ != nullptr) metrics_->SetCacheUsage(indexer_->Usage());
}

absl::StatusOr<IndexerShape> InProcessIndexerClient::GetShape(absl::Time /*deadline*/) {
  return IndexerShape{indexer_->options().num_heads, indexer_->options().head_dim};
}

absl::Status InProcessIndexerClient::CreateSequence(const IndexerSequenceSpec& spec,
                                                    absl::Time /*deadline*/) {
  absl::Status status =
      spec.prefix_source_id.has_value()
          ? indexer_->CreateSequenceFromPrefix(spec.sequence_id, spec.options,
                                               *spec.prefix_source_id, spec.prefix_slots)
          : indexer_->CreateSequence(spec.sequence_id, spec.options);
  UpdateCacheMetrics();
  return Prefixed(status, "CreateSequence");
}

std::unique_ptr<IndexKeyAppend> InProcessIndexerClient::BeginAppend(uint64_t sequence_id,
                                                                    absl::Time /*deadline*/) {
  return std::make_unique<InProcessIndexKeyAppend>(indexer_, sequence_id,
                                                   [this] { UpdateCacheMetrics(); });
}

absl::Status InProcessIndexerClient::BeginTurn(uint64_t sequence_id, absl::Time /*deadline*/) {
  return Prefixed(indexer_->BeginTurn(sequence_id), "BeginTurn");
}

absl::Status InProcessIndexerClient::Commit(uint64_t sequence_id, int accepted,
                                            absl::Time /*deadline*/) {
  absl::Status status = indexer_->Commit(sequence_id, accepted);
  UpdateCacheMetrics();
  return Prefixed(status, "Commit");
}

absl::Status InProcessIndexerClient::Release(uint64_t sequence_id, absl::Time /*deadline*/) {
  absl::Status status = indexer_->Release(sequence_id);
  UpdateCacheMetrics();
  return Prefixed(status, "Release");
}

IndexerClientFactory InProcessIndexerClient::Factory(
    Indexer* indexer, IndexerMetrics* metrics,
    std::function<bool(const std::string&)> is_own_address) {
  auto client = std::make_shared<InProcessIndexerClient>(indexer, metrics);
  return [client, is_own_address = std::move(is_own_address)](
             const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    if (address != kInProcessIndexerAddress && !(is_own_address && is_own_address(address))) {
      return absl::InvalidArgumentError(
          absl::StrCat("this attention worker serves its co-located indexer (\"",
                       kInProcessIndexerAddress, "\") only, not indexer worker ", address));
    }
    return std::shared_ptr<IndexerClient>(client);
  };
}

}  // namespace dsa
