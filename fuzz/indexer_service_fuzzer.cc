// libFuzzer harness of every RPC handler of dsa.indexer.v1.IndexerService in-process
// (IndexerServiceImpl over a small CPU Indexer): an input is a sequence of calls (call_frames.h)
// (two callers on the streams). Consecutive AppendIndexKeys frames of one caller are one client
// stream, as are consecutive SelectStream frames; their messages reach the handler as raw bytes.
// Checks: never a crash or a sanitizer report; no answer is UNKNOWN, INTERNAL or DATA_LOSS (a
// refusal has a precise code); an OK select has one [rows, K] selection per group; once every
// sequence the input created is released, the engine holds no sequence and no block (nothing leaks,
// every failed append and select was undone).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dsa/indexer/v1/indexer.pb.h"
#include "fuzz/call_frames.h"
#include "grpcpp/support/byte_buffer.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "proto/tensor_codec.h"

namespace {

namespace v1 = ::dsa::indexer::v1;
using dsa::fuzz::Frame;

constexpr int kHeads = 4;
constexpr int kHeadDim = 8;
constexpr int64_t kCapacityBlocks = 64;
// The unary handlers are called without a ServerContext, so as the anonymous caller ""; a stream
// frame's high bit makes it another caller's (whose use of those sequences is refused).
const char* const kCallers[] = {"", "attention-b"};

enum Method : uint8_t {
  kCreate,
  kAppend,
  kSelect,
  kSelectStream,
  kCommit,
  kBeginTurn,
  kRelease,
  kGetLoad,
  kMethods
};

using dsa::fuzz::Check;
using dsa::fuzz::CheckCode;

const std::vector<const google::protobuf::Message*>& Prototypes() {
  static const auto* prototypes = new std::vector<const google::protobuf::Message*>{
      &v1::CreateSequenceRequest::default_instance(),
      &v1::AppendIndexKeysRequest::default_instance(),
      &v1::SelectRequest::default_instance(),
      &v1::SelectRequest::default_instance(),
      &v1::CommitRequest::default_instance(),
      &v1::BeginTurnRequest::default_instance(),
      &v1::ReleaseRequest::default_instance(),
      &v1::GetLoadRequest::default_instance()};
  return *prototypes;
}

dsa::Indexer& Engine() {
  static dsa::Indexer* indexer = [] {
    auto created = dsa::Indexer::Create({kCapacityBlocks, kHeads, kHeadDim});
    Check(created.ok());
    return created->release();
  }();
  return *indexer;
}

dsa::IndexerServiceImpl& Service() {
  static auto* service = new dsa::IndexerServiceImpl(&Engine(), nullptr);
  return *service;
}

grpc::ByteBuffer Bytes(const std::string& message) {
  grpc::Slice slice(message);
  return grpc::ByteBuffer(&slice, 1);
}

template <typename Request>
bool Parse(const Frame& frame, Request* request) {
  return request->ParseFromString(frame.message);
}

// A seed: two layers of keys appended in one stream, then a select of both layers and a commit.
void WriteSeeds(const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::vector<Frame> frames;
  v1::CreateSequenceRequest create;
  create.set_sequence_id(1);
  create.set_num_layers(2);
  create.set_top_k(4);
  frames.push_back(dsa::fuzz::MakeFrame(kCreate, create));
  std::vector<float> keys(static_cast<size_t>(70) * kHeadDim);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>((i * 37) % 17) - 8.0f;
  for (int layer = 0; layer < 2; ++layer) {
    v1::AppendIndexKeysRequest chunk;
    chunk.set_sequence_id(1);
    chunk.set_layer(layer);
    const int64_t key_shape[] = {70, kHeadDim};
    dsa::EncodeFloatTensor(keys, key_shape, chunk.mutable_keys());
    frames.push_back(dsa::fuzz::MakeFrame(kAppend, chunk));
  }
  v1::SelectRequest select;
  for (int layer = 0; layer < 2; ++layer) {
    v1::RowGroup* group = select.add_groups();
    group->set_sequence_id(1);
    group->set_layer(layer);
    group->set_first_position(69);
    const int64_t query_shape[] = {1, kHeads, kHeadDim};
    const int64_t weight_shape[] = {1, kHeads};
    dsa::EncodeFloatTensor(std::vector<float>(kHeads * kHeadDim, 0.5f), query_shape,
                           group->mutable_queries());
    dsa::EncodeFloatTensor(std::vector<float>(kHeads, 1.0f), weight_shape,
                           group->mutable_head_weights());
  }
  frames.push_back(dsa::fuzz::MakeFrame(kSelect, select));
  frames.push_back(dsa::fuzz::MakeFrame(kSelectStream, select));
  v1::CommitRequest commit;
  commit.set_sequence_id(1);
  commit.set_accepted(1);
  frames.push_back(dsa::fuzz::MakeFrame(kCommit, commit));
  frames.push_back(dsa::fuzz::MakeFrame(kGetLoad, v1::GetLoadRequest()));
  std::ofstream(dir + "/append_select_commit.bin", std::ios::binary)
      << dsa::fuzz::SerializeFrames(frames);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("DSA_FUZZ_SEED_DIR"); dir != nullptr) WriteSeeds(dir);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return dsa::fuzz::MutateFrames(data, size, max_size, seed, Prototypes());
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsa::IndexerServiceImpl& service = Service();
  const std::vector<Frame> frames = dsa::fuzz::ParseFrames(data, size, kMethods);
  std::set<uint64_t> created;
  for (size_t i = 0; i < frames.size();) {
    const Frame& frame = frames[i];
    const std::string caller = kCallers[frame.second_caller ? 1 : 0];
    if (frame.method == kAppend || frame.method == kSelectStream) {
      // This frame and the next ones of the same method and caller are one stream.
      size_t end = i;
      while (end < frames.size() && frames[end].method == frame.method &&
             frames[end].second_caller == frame.second_caller) {
        ++end;
      }
      size_t next = i;
      auto read = [&](grpc::ByteBuffer* buffer) {
        if (next == end) return false;
        *buffer = Bytes(frames[next++].message);
        return true;
      };
      grpc::Status status;
      if (frame.method == kAppend) {
        status = service.AppendIndexKeysFrom(
            caller, read, [] { return false; },
            [](const v1::AppendIndexKeysResponse& response) {
              Check(response.keys_appended() >= 0);
              return true;
            });
      } else {
        status = service.SelectStreamFrom(caller, read, [](const v1::SelectResponse& response) {
          if (response.has_error())
            CheckCode(static_cast<grpc::StatusCode>(response.error().code()));
          return true;
        });
      }
      CheckCode(status.error_code());
      // Another caller's append to a sequence this input created is refused, whatever follows.
      v1::AppendIndexKeysRequest first;
      if (frame.method == kAppend && frame.second_caller && first.ParseFromString(frame.message) &&
          created.contains(first.sequence_id())) {
        Check(status.error_code() == grpc::StatusCode::PERMISSION_DENIED);
      }
      i = end;
      continue;
    }
    grpc::Status status;
    switch (frame.method) {
      case kCreate: {
        v1::CreateSequenceRequest request;
        v1::CreateSequenceResponse response;
        if (!Parse(frame, &request)) break;
        status = service.CreateSequence(nullptr, &request, &response);
        if (status.ok()) created.insert(request.sequence_id());
        break;
      }
      case kSelect: {
        v1::SelectRequest request;
        v1::SelectResponse response;
        if (!Parse(frame, &request)) break;
        status = service.Select(nullptr, &request, &response);
        if (status.ok()) {
          Check(response.selections_size() == request.groups_size());
          for (const v1::GroupSelection& selection : response.selections()) {
            const int64_t shape[] = {-1, -1};
            Check(dsa::DecodeInt32Tensor(selection.selections(), shape, "selections").ok());
          }
        }
        break;
      }
      case kCommit: {
        v1::CommitRequest request;
        v1::CommitResponse response;
        if (Parse(frame, &request)) status = service.Commit(nullptr, &request, &response);
        break;
      }
      case kBeginTurn: {
        v1::BeginTurnRequest request;
        v1::BeginTurnResponse response;
        if (Parse(frame, &request)) status = service.BeginTurn(nullptr, &request, &response);
        break;
      }
      case kRelease: {
        v1::ReleaseRequest request;
        v1::ReleaseResponse response;
        if (!Parse(frame, &request)) break;
        status = service.Release(nullptr, &request, &response);
        if (status.ok()) created.erase(request.sequence_id());
        break;
      }
      default: {
        v1::GetLoadRequest request;
        v1::GetLoadResponse response;
        status = service.GetLoad(nullptr, &request, &response);
        Check(status.ok() && response.used_blocks() <= response.capacity_blocks());
        break;
      }
    }
    CheckCode(status.error_code());
    ++i;
  }
  // Nothing may outlive the input: release what it created; then the pool is empty again.
  for (uint64_t id : created) {
    v1::ReleaseRequest request;
    request.set_sequence_id(id);
    v1::ReleaseResponse response;
    Check(service.Release(nullptr, &request, &response).ok());
  }
  Check(Engine().num_sequences() == 0);
  Check(Engine().Usage().used_blocks == 0);
  Check(service.owned_sequences() == 0);  // no owner entry outlives its sequence
  return 0;
}
