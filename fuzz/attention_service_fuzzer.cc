// libFuzzer harness of every RPC handler of dsa.attention.v1.AttentionService in-process
// (AttentionServiceImpl over the CPU backend, its indexer co-located in the process as
// `dsa-attention --transport inprocess` has it): an input is a sequence of calls (call_frames.h).
// Checks: never a crash or a sanitizer report; no answer is UNKNOWN, INTERNAL or DATA_LOSS; an
// OK DecodeStep answers every sequence of the step; once every sequence the input named is
// released, neither the attention engine nor the indexer holds a sequence, a KV slot or a block.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "attention_worker/pattern_model.h"
#include "attention_worker/service.h"
#include "common/mli_schedule.h"
#include "dsa/attention/v1/attention.pb.h"
#include "fuzz/call_frames.h"
#include "indexer_service/indexer.h"
#include "transport/in_process_indexer_client.h"

namespace {

namespace av1 = ::dsa::attention::v1;
using dsa::fuzz::Frame;

constexpr int kHeads = 4;
constexpr int kHeadDim = 8;
constexpr int64_t kIndexerBlocks = 96;      // 6,144 slots over all layers and sequences
constexpr int64_t kKvCapacitySlots = 4096;  // the attention worker's KV cache

enum Method : uint8_t { kGetInfo, kPrefill, kDecodeStep, kCommit, kRelease, kMethods };

using dsa::fuzz::Check;
using dsa::fuzz::CheckCode;

const std::vector<const google::protobuf::Message*>& Prototypes() {
  static const auto* prototypes = new std::vector<const google::protobuf::Message*>{
      &av1::GetInfoRequest::default_instance(), &av1::PrefillRequest::default_instance(),
      &av1::DecodeStepRequest::default_instance(), &av1::CommitRequest::default_instance(),
      &av1::ReleaseRequest::default_instance()};
  return *prototypes;
}

dsa::Indexer& IndexerEngine() {
  static dsa::Indexer* indexer = [] {
    auto created = dsa::Indexer::Create({kIndexerBlocks, kHeads, kHeadDim});
    Check(created.ok());
    return created->release();
  }();
  return *indexer;
}

dsa::AttentionServiceImpl& Service() {
  static dsa::AttentionServiceImpl* service = [] {
    auto schedule = dsa::MliSchedule::FromPattern("FSFS", 1);
    Check(schedule.ok());
    dsa::PatternModelConfig config;
    config.num_layers = static_cast<int>(schedule->full_layers().size());
    config.num_heads = kHeads;
    config.head_dim = kHeadDim;
    config.num_diagonals = 1;
    auto model = dsa::PatternModel::Create(config);
    Check(model.ok());
    dsa::AttentionWorkerOptions options;
    options.kv_dim = 8;
    options.attention_heads = 2;
    options.engine.kv_capacity_slots = kKvCapacitySlots;
    options.engine.prefill_threads = 1;
    auto engine = dsa::MakeCpuAttentionEngine(
        *schedule, *model, options, dsa::InProcessIndexerClient::Factory(&IndexerEngine()));
    Check(engine.ok());
    return new dsa::AttentionServiceImpl(std::move(*engine));
  }();
  return *service;
}

void WriteSeeds(const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::vector<Frame> frames;
  frames.push_back(dsa::fuzz::MakeFrame(kGetInfo, av1::GetInfoRequest()));
  av1::PrefillRequest prefill;
  prefill.set_sequence_id(1);
  prefill.set_context_length(300);
  prefill.set_indexer_worker(dsa::kInProcessIndexerAddress);
  prefill.mutable_settings()->set_top_k(16);
  frames.push_back(dsa::fuzz::MakeFrame(kPrefill, prefill));
  av1::DecodeStepRequest step;
  av1::SequenceStep* member = step.add_sequences();
  member->set_sequence_id(1);
  member->set_rows(2);
  frames.push_back(dsa::fuzz::MakeFrame(kDecodeStep, step));
  av1::CommitRequest commit;
  commit.set_sequence_id(1);
  commit.set_accepted(1);
  frames.push_back(dsa::fuzz::MakeFrame(kCommit, commit));
  prefill.set_continue_sequence(true);
  prefill.set_context_length(420);
  frames.push_back(dsa::fuzz::MakeFrame(kPrefill, prefill));
  av1::ReleaseRequest release;
  release.set_sequence_id(1);
  release.set_keep_indexer_sequence(true);
  frames.push_back(dsa::fuzz::MakeFrame(kRelease, release));
  std::ofstream(dir + "/prefill_step_commit_continue.bin", std::ios::binary)
      << dsa::fuzz::SerializeFrames(frames);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // One OpenMP thread (unless the run says otherwise): an input's prefills are small, and idle
  // OpenMP workers spin between parallel regions, which cost most of each input (40% of the time
  // with 2 threads here, more with 16 jobs of 16 threads each on the lent host).
  setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
  if (const char* dir = std::getenv("DSA_FUZZ_SEED_DIR"); dir != nullptr) WriteSeeds(dir);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return dsa::fuzz::MutateFrames(data, size, max_size, seed, Prototypes());
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsa::AttentionServiceImpl& service = Service();
  std::set<uint64_t> named;  // every sequence id a Prefill named
  for (const Frame& frame : dsa::fuzz::ParseFrames(data, size, kMethods)) {
    grpc::Status status;
    switch (frame.method) {
      case kGetInfo: {
        av1::GetInfoRequest request;
        av1::GetInfoResponse response;
        status = service.GetInfo(nullptr, &request, &response);
        Check(status.ok() && response.kv_used_slots() <= response.kv_capacity_slots());
        break;
      }
      case kPrefill: {
        av1::PrefillRequest request;
        av1::PrefillResponse response;
        if (!request.ParseFromString(frame.message)) break;
        named.insert(request.sequence_id());
        status = service.Prefill(nullptr, &request, &response);
        break;
      }
      case kDecodeStep: {
        av1::DecodeStepRequest request;
        av1::DecodeStepResponse response;
        if (!request.ParseFromString(frame.message)) break;
        status = service.DecodeStep(nullptr, &request, &response);
        if (status.ok()) Check(response.sequences_size() == request.sequences_size());
        break;
      }
      case kCommit: {
        av1::CommitRequest request;
        av1::CommitResponse response;
        if (request.ParseFromString(frame.message)) {
          status = service.Commit(nullptr, &request, &response);
        }
        break;
      }
      default: {
        av1::ReleaseRequest request;
        av1::ReleaseResponse response;
        if (request.ParseFromString(frame.message)) {
          status = service.Release(nullptr, &request, &response);
        }
        break;
      }
    }
    CheckCode(status.error_code());
  }
  // Release everything the input made, kept indexer sequences (prefix donors) too.
  for (uint64_t id : named) {
    av1::ReleaseRequest request;
    request.set_sequence_id(id);
    av1::ReleaseResponse response;
    const grpc::Status status = service.Release(nullptr, &request, &response);
    Check(status.ok() || status.error_code() == grpc::StatusCode::NOT_FOUND);
    (void)IndexerEngine().Release(id);
  }
  av1::GetInfoRequest info_request;
  av1::GetInfoResponse info;
  Check(service.GetInfo(nullptr, &info_request, &info).ok());
  Check(info.sequences() == 0 && info.kv_used_slots() == 0);
  Check(IndexerEngine().num_sequences() == 0);
  Check(IndexerEngine().Usage().used_blocks == 0);
  Check(service.owned_sequences() == 0);  // no owner entry outlives its sequence
  return 0;
}
