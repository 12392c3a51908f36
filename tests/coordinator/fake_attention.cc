// The attention-worker test double (see fake_attention.h).
#include "tests/coordinator/fake_attention.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "proto/lease_codec.h"
#include "proto/tensor_codec.h"
#include "tests/coordinator/tiny_model.h"

namespace dsa::testing {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

grpc::Status FakeAttentionService::GetInfo(grpc::ServerContext* context,
                                           const av1::GetInfoRequest* request,
                                           av1::GetInfoResponse* response) {
  absl::MutexLock lock(&mu_);
  response->set_num_model_layers(2 * shape_.num_full_layers);
  response->set_num_full_layers(shape_.num_full_layers);
  response->set_lag_depth(1);
  response->set_num_heads(shape_.num_heads);
  response->set_head_dim(shape_.head_dim);
  response->set_kv_capacity_slots(shape_.kv_capacity_slots);
  response->set_sequences(static_cast<int32_t>(sequences_.size()));
  response->set_instance_id(instance_id_);
  response->set_model(shape_.model);
  response->set_vocab_size(shape_.vocab_size);
  response->set_eos_token_id(shape_.eos_token_id);
  response->set_max_context(shape_.max_context);
  return grpc::Status::OK;
}

void FakeAttentionService::SetInstanceId(const std::string& instance_id) {
  absl::MutexLock lock(&mu_);
  instance_id_ = instance_id;
}

iv1::IndexerService::Stub& FakeAttentionService::IndexerStub(const std::string& address) {
  auto& stub = stubs_[address];
  if (stub == nullptr) {
    stub = iv1::IndexerService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return *stub;
}

grpc::Status FakeAttentionService::AppendKeys(iv1::IndexerService::Stub& stub, uint64_t sequence_id,
                                              int64_t first, int64_t last) {
  if (last <= first) return grpc::Status::OK;
  const std::vector<float> zeros(static_cast<size_t>(last - first) * shape_.head_dim, 0.0f);
  const std::vector<int64_t> shape = {last - first, shape_.head_dim};
  grpc::ClientContext context;
  iv1::AppendIndexKeysResponse response;
  auto writer = stub.AppendIndexKeys(&context, &response);
  for (int layer = 0; layer < shape_.num_full_layers; ++layer) {
    iv1::AppendIndexKeysRequest chunk;
    chunk.set_sequence_id(sequence_id);
    chunk.set_layer(layer);
    chunk.set_first_slot(first);
    EncodeFloatTensor(zeros, shape, chunk.mutable_keys());
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status FakeAttentionService::Prefill(grpc::ServerContext* context,
                                           const av1::PrefillRequest* request,
                                           av1::PrefillResponse* response) {
  iv1::IndexerService::Stub* stub = nullptr;
  int64_t indexer_slots = 0;
  {
    absl::MutexLock lock(&mu_);
    prefills_.push_back(*request);
    auto trace = context->client_metadata().find("traceparent");
    prefill_traceparents_.push_back(trace == context->client_metadata().end()
                                        ? std::string()
                                        : std::string(trace->second.data(), trace->second.size()));
    mu_.Await(absl::Condition(
        +[](bool* hold) { return !*hold; }, &hold_prefills_));  // HoldPrefills
    auto it = sequences_.find(request->sequence_id());
    if (request->continue_sequence()) {
      if (it == sequences_.end()) {
        return {grpc::StatusCode::NOT_FOUND, "continue of an unknown sequence"};
      }
      if (it->second.pending_rows > 1) {
        return {grpc::StatusCode::FAILED_PRECONDITION, "a step awaits Commit"};
      }
      if (request->context_length() < it->second.length) {
        return {grpc::StatusCode::INVALID_ARGUMENT, "context shorter than the sequence"};
      }
      indexer_slots = it->second.context_length;
    } else if (it != sequences_.end()) {
      return {grpc::StatusCode::ALREADY_EXISTS, "sequence exists"};
    }
    if (absl::Status refused = leases_.Check(DecodeLease(request->lease()), ""); !refused.ok()) {
      return {static_cast<grpc::StatusCode>(refused.code()), std::string(refused.message())};
    }
    if (shape_.vocab_size > 0) {  // the tiny real model: the new slots' tokens
      const int64_t held = request->continue_sequence() ? it->second.length : 0;
      if (request->tokens_size() != request->context_length() - held) {
        return {grpc::StatusCode::INVALID_ARGUMENT,
                absl::StrCat(request->tokens_size(), " tokens for slots ", held, "..",
                             request->context_length())};
      }
      for (int32_t token : request->tokens()) {
        if (token < 0 || token >= shape_.vocab_size) {
          return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("token ", token)};
        }
      }
    }
    stub = &IndexerStub(request->indexer_worker());
  }
  int64_t first = request->prefix_slots();
  if (request->continue_sequence()) {
    first = indexer_slots;
    grpc::Status status =
        AppendKeys(*stub, request->sequence_id(), first, request->context_length());
    if (!status.ok()) return status;
    grpc::ClientContext begin_context;
    iv1::BeginTurnRequest begin;
    begin.set_sequence_id(request->sequence_id());
    iv1::BeginTurnResponse begun;
    status = stub->BeginTurn(&begin_context, begin, &begun);
    if (!status.ok()) return status;
  } else {
    grpc::ClientContext create_context;
    iv1::CreateSequenceRequest create;
    create.set_sequence_id(request->sequence_id());
    create.set_num_layers(shape_.num_full_layers);
    create.set_top_k(request->settings().top_k());
    if (request->has_lease()) *create.mutable_lease() = request->lease();
    *create.mutable_spin() = request->settings().spin();
    if (request->has_prefix_source_id()) {
      create.set_prefix_source_id(request->prefix_source_id());
      create.set_prefix_slots(request->prefix_slots());
    }
    iv1::CreateSequenceResponse created;
    grpc::Status status = stub->CreateSequence(&create_context, create, &created);
    if (!status.ok()) return status;
    status = AppendKeys(*stub, request->sequence_id(), first, request->context_length());
    if (!status.ok()) {
      grpc::ClientContext release_context;
      iv1::ReleaseRequest release;
      release.set_sequence_id(request->sequence_id());
      iv1::ReleaseResponse released;
      (void)stub->Release(&release_context, release, &released);
      return status;
    }
  }
  absl::MutexLock lock(&mu_);
  if (auto held = leases_.Attach(request->sequence_id(), DecodeLease(request->lease()), "");
      held.ok()) {
    DropLocked(held->released);
  }
  Sequence& s = sequences_[request->sequence_id()];
  s.context_length = request->context_length();
  s.length = request->context_length();
  s.pending_rows = 0;
  s.indexer = request->indexer_worker();
  if (shape_.vocab_size > 0) {
    s.kv.insert(s.kv.end(), request->tokens().begin(), request->tokens().end());
    s.sampling = request->sampling();
    response->set_next_token(TinyModelNext(s.kv, shape_.vocab_size, s.sampling));
  }
  response->set_slots(request->context_length());
  response->set_slots_appended(request->context_length() - first);
  response->set_seconds(0.001);
  return grpc::Status::OK;
}

grpc::Status FakeAttentionService::DecodeStep(grpc::ServerContext* context,
                                              const av1::DecodeStepRequest* request,
                                              av1::DecodeStepResponse* response) {
  int delay_ms = 0;
  {
    absl::MutexLock lock(&mu_);
    delay_ms = step_delay_ms_;
  }
  // Simulates the worker's step time (SetStepDelayMs), which keeps requests running meanwhile.
  std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  absl::MutexLock lock(&mu_);
  ++decode_steps_;
  max_batch_size_ = std::max(max_batch_size_, request->sequences_size());
  absl::flat_hash_set<uint64_t> seen;
  for (const av1::SequenceStep& step : request->sequences()) {
    auto it = sequences_.find(step.sequence_id());
    if (it == sequences_.end()) {
      return {grpc::StatusCode::NOT_FOUND, absl::StrCat("sequence ", step.sequence_id())};
    }
    if (!seen.insert(step.sequence_id()).second) {
      return {grpc::StatusCode::INVALID_ARGUMENT, "a sequence twice"};
    }
    if (step.rows() < 1 || step.rows() > 5) {
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("rows ", step.rows())};
    }
    if (it->second.pending_rows > 1) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "a step awaits Commit"};
    }
    if (fail_context_.has_value() && it->second.context_length == *fail_context_) {
      return {grpc::StatusCode::UNAVAILABLE, "injected failure"};
    }
    if (shape_.vocab_size > 0 && step.tokens_size() != step.rows()) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat(step.tokens_size(), " tokens for ", step.rows(), " rows")};
    }
  }
  steps_.push_back(*request);
  for (const av1::SequenceStep& step : request->sequences()) {
    Sequence& s = sequences_.at(step.sequence_id());
    av1::SequenceStepResult* result = response->add_sequences();
    result->set_sequence_id(step.sequence_id());
    result->set_first_position(s.length);
    result->set_blocks_scored(step.rows());
    result->set_blocks_visible((s.length / 64 + 1) * shape_.num_full_layers);
    if (shape_.vocab_size > 0) {
      std::vector<int32_t> seen = s.kv;  // row r sees the KV and the rows' tokens up to its own
      for (int r = 0; r < step.rows(); ++r) {
        seen.push_back(step.tokens(r));
        result->add_sampled_tokens(TinyModelNext(seen, shape_.vocab_size, s.sampling));
      }
      if (step.rows() == 1) s.kv.push_back(step.tokens(0));
    }
    s.length += step.rows();
    if (step.rows() > 1) {
      s.pending_rows = step.rows();
      s.pending_tokens.assign(step.tokens().begin(), step.tokens().end());
    }
  }
  for (int l = 0; l < 2 * shape_.num_full_layers; ++l) response->add_selection_wait_seconds(0.0);
  response->set_seconds(0.0001);
  return grpc::Status::OK;
}

grpc::Status FakeAttentionService::Commit(grpc::ServerContext* context,
                                          const av1::CommitRequest* request,
                                          av1::CommitResponse* response) {
  absl::MutexLock lock(&mu_);
  commits_.push_back(*request);
  auto it = sequences_.find(request->sequence_id());
  if (it == sequences_.end()) return {grpc::StatusCode::NOT_FOUND, "unknown sequence"};
  Sequence& s = it->second;
  if (s.pending_rows <= 1) return {grpc::StatusCode::FAILED_PRECONDITION, "nothing pending"};
  if (request->accepted() < 0 || request->accepted() >= s.pending_rows) {
    return {grpc::StatusCode::OUT_OF_RANGE, "accepted outside 0..d"};
  }
  s.length = s.length - s.pending_rows + request->accepted() + 1;
  s.pending_rows = 0;
  if (!s.pending_tokens.empty()) {
    s.kv.insert(s.kv.end(), s.pending_tokens.begin(),
                s.pending_tokens.begin() + request->accepted() + 1);
    s.pending_tokens.clear();
  }
  return grpc::Status::OK;
}

grpc::Status FakeAttentionService::Release(grpc::ServerContext* context,
                                           const av1::ReleaseRequest* request,
                                           av1::ReleaseResponse* response) {
  iv1::IndexerService::Stub* stub = nullptr;
  {
    absl::MutexLock lock(&mu_);
    releases_.push_back(*request);
    if (fail_releases_ > 0) {
      --fail_releases_;
      return {grpc::StatusCode::UNAVAILABLE, "the fake is unreachable"};
    }
    auto it = sequences_.find(request->sequence_id());
    if (it == sequences_.end()) return {grpc::StatusCode::NOT_FOUND, "unknown sequence"};
    if (!request->keep_indexer_sequence()) stub = &IndexerStub(it->second.indexer);
    sequences_.erase(it);
    leases_.Detach(request->sequence_id());
  }
  if (stub != nullptr) {
    grpc::ClientContext release_context;
    iv1::ReleaseRequest release;
    release.set_sequence_id(request->sequence_id());
    iv1::ReleaseResponse released;
    return stub->Release(&release_context, release, &released);
  }
  return grpc::Status::OK;
}

grpc::Status FakeAttentionService::RenewLease(grpc::ServerContext* /*context*/,
                                              const av1::RenewLeaseRequest* request,
                                              av1::RenewLeaseResponse* response) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<SequenceLeases::Renewal> renewal =
      leases_.Renew(DecodeLease(request->lease()), "");
  if (!renewal.ok()) {
    return {static_cast<grpc::StatusCode>(renewal.status().code()),
            std::string(renewal.status().message())};
  }
  DropLocked(renewal->released);
  response->mutable_state()->set_renewed(renewal->renewed);
  response->mutable_state()->set_sequences(renewal->sequences);
  response->mutable_state()->set_superseded_released(renewal->superseded);
  return grpc::Status::OK;
}

void FakeAttentionService::DropLocked(const std::vector<uint64_t>& ids) {
  for (const uint64_t id : ids) sequences_.erase(id);
  for (const uint64_t id : leases_.TakeExpired()) sequences_.erase(id);
}

void FakeAttentionService::FailDecodeOfContext(int64_t context_length) {
  absl::MutexLock lock(&mu_);
  fail_context_ = context_length;
}

void FakeAttentionService::SetStepDelayMs(int delay_ms) {
  absl::MutexLock lock(&mu_);
  step_delay_ms_ = delay_ms;
}

void FakeAttentionService::HoldPrefills() {
  absl::MutexLock lock(&mu_);
  hold_prefills_ = true;
}

void FakeAttentionService::ReleasePrefills() {
  absl::MutexLock lock(&mu_);
  hold_prefills_ = false;
}

bool FakeAttentionService::AwaitState(std::function<bool()> done, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(
                                  +[](std::function<bool()>* f) { return (*f)(); }, &done),
                              timeout);
}

bool FakeAttentionService::AwaitReleases(size_t count, absl::Duration timeout) {
  return AwaitState([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return releases_.size() == count; },
                    timeout);
}

bool FakeAttentionService::AwaitNumSequences(int count, absl::Duration timeout) {
  return AwaitState(
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return static_cast<int>(sequences_.size()) == count; },
      timeout);
}

bool FakeAttentionService::AwaitPrefills(size_t count, absl::Duration timeout) {
  return AwaitState([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return prefills_.size() == count; },
                    timeout);
}

bool FakeAttentionService::AwaitDecodeStepsOver(int count, absl::Duration timeout) {
  return AwaitState([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return decode_steps_ > count; },
                    timeout);
}

std::optional<int64_t> FakeAttentionService::Length(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return std::nullopt;
  return it->second.length;
}

int FakeAttentionService::NumSequences() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sequences_.size());
}

std::vector<av1::PrefillRequest> FakeAttentionService::prefills() {
  absl::MutexLock lock(&mu_);
  return prefills_;
}

void FakeAttentionService::FailReleases(int count) {
  absl::MutexLock lock(&mu_);
  fail_releases_ = count;
}

std::vector<std::string> FakeAttentionService::prefill_traceparents() {
  absl::MutexLock lock(&mu_);
  return prefill_traceparents_;
}

std::vector<av1::ReleaseRequest> FakeAttentionService::releases() {
  absl::MutexLock lock(&mu_);
  return releases_;
}

std::vector<av1::CommitRequest> FakeAttentionService::commits() {
  absl::MutexLock lock(&mu_);
  return commits_;
}

std::vector<av1::DecodeStepRequest> FakeAttentionService::steps() {
  absl::MutexLock lock(&mu_);
  return steps_;
}

std::vector<int32_t> FakeAttentionService::KvTokens(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? std::vector<int32_t>{} : it->second.kv;
}

int FakeAttentionService::max_batch_size() {
  absl::MutexLock lock(&mu_);
  return max_batch_size_;
}

int FakeAttentionService::decode_steps() {
  absl::MutexLock lock(&mu_);
  return decode_steps_;
}

}  // namespace dsa::testing
