// libFuzzer harness of the coordinator's RPCs (Generate, Abort, GetLoad) in-process: a fresh
// CoordinatorEngine per input, its decode loops running, over in-memory workers (two attention,
// two indexer; tests/coordinator/fake_workers.h) that the input kills, hangs, stalls, drains,
// restarts and revives between calls. An input is a sequence of calls (call_frames.h): each
// Generate runs on its own thread (as gRPC's handler threads do), so requests, faults and
// migrations interleave; at the end every worker is revived and every request still in flight
// aborted. Checks: never a crash or a sanitizer report; no status is UNKNOWN, INTERNAL or
// DATA_LOSS; a request ValidateGenerateRequest refuses gets INVALID_ARGUMENT; an OK stream has
// Admitted first, Finished last, and Tokens contiguous from its context summing to max_new_tokens;
// an Abort is OK only from the caller that started the request, PERMISSION_DENIED only for one the
// other caller started; once every request has ended, the coordinator reports nothing queued or
// running and the workers hold exactly the sequences it retained (nothing lost, nothing leaked,
// whatever failed in between).
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "dsa/coordinator/v1/coordinator.pb.h"
#include "fuzz/call_frames.h"
#include "prometheus/registry.h"
#include "tests/coordinator/fake_workers.h"

namespace {

namespace cv1 = ::dsa::coordinator::v1;
using dsa::fuzz::Check;
using dsa::fuzz::Frame;

const char* const kCallers[] = {"router-a", "router-b"};
const char* const kWorkers[] = {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.1.1:7100", "10.0.1.2:7100"};
constexpr int kAttention = 2;  // kWorkers[0, 2) are attention workers, the rest indexers

// A fault frame is a GenerateRequest whose context_length is the action and max_new_tokens the
// worker (both taken modulo their counts); an odd draft_length makes kHang / kUnhang a stall (the
// worker's Prefill and DecodeStep held open until cancelled: FakeWorkers::SetStalled).
enum Method : uint8_t { kGenerate, kAbort, kGetLoad, kFault, kMethods };
enum Fault : uint8_t { kDown, kUp, kHang, kUnhang, kNotReady, kReady, kRestart, kRefresh, kFaults };

const std::vector<const google::protobuf::Message*>& Prototypes() {
  static const auto* prototypes = new std::vector<const google::protobuf::Message*>{
      &cv1::GenerateRequest::default_instance(), &cv1::AbortRequest::default_instance(),
      &cv1::GetLoadRequest::default_instance(), &cv1::GenerateRequest::default_instance()};
  return *prototypes;
}

// A client that reads every event at once and checks the stream's order as it goes.
class CheckingStream final : public dsa::GenerateStream {
 public:
  explicit CheckingStream(int64_t context) : next_position_(context) {}
  bool Write(const dsa::GenerateEvent& plain) override {
    const cv1::GenerateEvent event = dsa::ToGenerateEventProto(plain);  // as the adapter sends it
    absl::MutexLock lock(&mu_);
    if (cancelled_) return false;
    if (events_ == 0) Check(event.has_admitted());
    Check(!finished_);  // nothing after Finished
    if (event.has_tokens()) {
      Check(event.tokens().first_position() == next_position_ && event.tokens().count() >= 1);
      next_position_ += event.tokens().count();
      tokens_ += event.tokens().count();
    }
    if (event.has_finished()) {
      finished_ = true;
      Check(event.finished().generated_tokens() == tokens_);
    }
    ++events_;
    return true;
  }
  bool IsCancelled() override {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }
  void TryCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  // What an OK stream must have seen.
  void CheckCompleted(int64_t max_new_tokens) {
    absl::MutexLock lock(&mu_);
    Check(finished_ && tokens_ == max_new_tokens);
  }

 private:
  absl::Mutex mu_;
  bool cancelled_ = false;
  bool finished_ = false;
  int64_t events_ = 0;
  int64_t tokens_ = 0;
  int64_t next_position_;
};

struct Call {
  std::string caller;
  cv1::GenerateRequest request;
  std::unique_ptr<CheckingStream> stream;
  absl::Status status;
  std::atomic<bool> returned{false};
  std::thread thread;
};

int64_t ContextOf(const cv1::GenerateRequest& r) {
  return r.has_context_tokens() ? r.context_tokens().tokens_size() : r.context_length();
}

void WriteSeeds(const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::vector<Frame> frames;
  cv1::GenerateRequest generate;
  generate.set_request_id("r1");
  generate.set_context_length(700);
  generate.set_max_new_tokens(12);
  generate.set_draft_length(2);
  generate.add_prefix_block_ids(7);
  frames.push_back(dsa::fuzz::MakeFrame(kGenerate, generate));
  generate.set_request_id("r2");
  generate.set_session_id("s1");
  generate.mutable_overrides()->set_top_k(64);
  frames.push_back(dsa::fuzz::MakeFrame(kGenerate, generate, /*second_caller=*/true));
  cv1::GenerateRequest fault;
  fault.set_context_length(kDown);
  fault.set_max_new_tokens(0);
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  frames.push_back(dsa::fuzz::MakeFrame(kGetLoad, cv1::GetLoadRequest()));
  cv1::AbortRequest abort;
  abort.set_request_id("r2");
  frames.push_back(dsa::fuzz::MakeFrame(kAbort, abort));
  fault.set_context_length(kUp);
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  std::ofstream(dir + "/generate_kill_abort.bin", std::ios::binary)
      << dsa::fuzz::SerializeFrames(frames);
  // A stalled attention worker (its step held open) seen by two checks, then let go.
  frames.clear();
  generate.clear_session_id();
  generate.clear_overrides();
  generate.set_request_id("r3");
  frames.push_back(dsa::fuzz::MakeFrame(kGenerate, generate));
  fault.set_context_length(kHang);
  fault.set_draft_length(1);  // a stall
  fault.set_max_new_tokens(0);
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  fault.set_context_length(kRefresh);
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  fault.set_context_length(kUnhang);
  frames.push_back(dsa::fuzz::MakeFrame(kFault, fault));
  std::ofstream(dir + "/generate_stall_checks.bin", std::ios::binary)
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
  static prometheus::Registry* registry = new prometheus::Registry();
  static dsa::CoordinatorMetrics* metrics = new dsa::CoordinatorMetrics(*registry);
  auto fakes = std::make_shared<dsa::testing::FakeWorkers>();
  dsa::CoordinatorOptions options;
  for (int w = 0; w < 4; ++w) {
    if (w < kAttention) {
      fakes->AddAttention(kWorkers[w]);
      options.attention_addresses.emplace_back(kWorkers[w]);
    } else {
      fakes->AddIndexer(kWorkers[w], /*capacity_blocks=*/4096);
      options.indexer_addresses.emplace_back(kWorkers[w]);
    }
  }
  options.worker_check_interval_ms = 0;  // the input's refresh frames and migrations check
  options.stall_timeout_ms = 0;
  options.max_queue = 8;
  options.max_running_per_attention = 4;
  options.retain_finished = false;
  options.rpc_timeout_ms = 1000;
  auto engine = dsa::CoordinatorEngine::Create(options, metrics, fakes);
  Check(engine.ok());

  std::vector<std::unique_ptr<Call>> calls;
  for (const Frame& frame : dsa::fuzz::ParseFrames(data, size, kMethods)) {
    const char* caller = kCallers[frame.second_caller ? 1 : 0];
    switch (frame.method) {
      case kGenerate: {
        auto call = std::make_unique<Call>();
        if (!call->request.ParseFromString(frame.message)) break;
        call->caller = caller;
        call->stream = std::make_unique<CheckingStream>(ContextOf(call->request));
        const bool valid = dsa::ValidateGenerateRequest(dsa::ToGenerateSpec(call->request)).ok();
        Call* c = call.get();
        c->thread = std::thread([&engine, c, caller, valid] {
          c->status = (*engine)->Generate(dsa::ToGenerateSpec(c->request), caller, "", *c->stream);
          if (!valid) Check(c->status.code() == absl::StatusCode::kInvalidArgument);
          c->returned = true;
        });
        calls.push_back(std::move(call));
        break;
      }
      case kAbort: {
        cv1::AbortRequest request;
        if (!request.ParseFromString(frame.message)) break;
        const absl::Status status = (*engine)->Abort(request.request_id(), caller);
        dsa::fuzz::CheckCode(static_cast<grpc::StatusCode>(status.code()));
        // OK only for the caller that started a request of that id (ids are scoped per caller:
        // another caller's request answers NOT_FOUND, never PERMISSION_DENIED, so it cannot be
        // probed).
        bool by_caller = false;
        for (const auto& call : calls) {
          by_caller |= call->request.request_id() == request.request_id() && call->caller == caller;
        }
        if (status.ok()) Check(by_caller);
        Check(!absl::IsPermissionDenied(status));
        break;
      }
      case kGetLoad: {
        const cv1::GetLoadResponse load = dsa::ToGetLoadResponse((*engine)->GetLoad());
        Check(load.queued() >= 0 && load.running() >= 0 &&
              load.cache_blocks_used() <= load.cache_blocks_capacity());
        break;
      }
      default: {
        cv1::GenerateRequest request;
        if (!request.ParseFromString(frame.message)) break;
        const auto fault =
            static_cast<Fault>(static_cast<uint64_t>(request.context_length()) % kFaults);
        const char* worker = kWorkers[static_cast<uint64_t>(request.max_new_tokens()) % 4];
        switch (fault) {
          case kDown:
          case kUp:
            fakes->SetDown(worker, fault == kDown);
            break;
          case kHang:
          case kUnhang:
            if (request.draft_length() % 2 != 0) {
              fakes->SetStalled(worker, fault == kHang);
            } else {
              fakes->SetHung(worker, fault == kHang);
            }
            break;
          case kNotReady:
          case kReady:
            fakes->SetNotReady(worker, fault == kNotReady);
            break;
          case kRestart:
            fakes->Restart(worker);
            break;
          default:
            (*engine)->RefreshWorkers();
            break;
        }
        break;
      }
    }
  }
  // Revive every worker, then end what still runs: every request ends, none hangs.
  for (const char* worker : kWorkers) {
    fakes->SetDown(worker, false);
    fakes->SetHung(worker, false);
    fakes->SetStalled(worker, false);
    fakes->SetNotReady(worker, false);
  }
  (*engine)->RefreshWorkers();
  int rounds = 0;
  for (bool all_returned = false; !all_returned;) {
    all_returned = true;
    for (auto& call : calls) {
      if (call->returned) continue;
      all_returned = false;
      for (const char* caller : kCallers)
        (void)(*engine)->Abort(call->request.request_id(), caller);
    }
    if (!all_returned) {
      // Once, then a short pause between looks, so that the handlers still migrating (whose
      // placement runs RefreshWorkers too) are not starved of the refresh lock.
      if (rounds++ == 0) (*engine)->RefreshWorkers();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  for (auto& call : calls) {
    call->thread.join();
    dsa::fuzz::CheckCode(static_cast<grpc::StatusCode>(call->status.code()));
    if (call->status.ok()) call->stream->CheckCompleted(call->request.max_new_tokens());
  }
  (*engine)->RefreshWorkers();  // the Releases that waited for a worker to come back
  const cv1::GetLoadResponse load = dsa::ToGetLoadResponse((*engine)->GetLoad());
  Check(load.queued() == 0 && load.running() == 0);
  // What the workers hold is what the coordinator retained (sessions kept for their next turn):
  // one sequence on an attention worker and one on an indexer each.
  int held[2] = {0, 0};  // [attention]
  for (int w = 0; w < 4; ++w) held[w < kAttention ? 1 : 0] += fakes->Sequences(kWorkers[w]);
  if (held[1] != load.retained_sequences() || held[0] != load.retained_sequences()) {
    std::fprintf(stderr, "held on attention %d, on indexers %d; retained %d\n", held[1], held[0],
                 static_cast<int>(load.retained_sequences()));
    for (int w = 0; w < 4; ++w) {
      std::fprintf(stderr, "  %s holds %d\n", kWorkers[w], fakes->Sequences(kWorkers[w]));
      if (w >= kAttention) continue;
      for (const auto& prefill : fakes->Prefills(kWorkers[w])) {
        std::fprintf(stderr, "    prefilled %llu (context %lld, continue %d)\n",
                     static_cast<unsigned long long>(prefill.sequence_id()),
                     static_cast<long long>(prefill.context_length()),
                     prefill.continue_sequence() ? 1 : 0);
      }
      for (uint64_t id : fakes->Released(kWorkers[w])) {
        std::fprintf(stderr, "    released %llu\n", static_cast<unsigned long long>(id));
      }
    }
    std::fprintf(stderr, "  GetLoad %s\n", load.ShortDebugString().c_str());
    Check(false);
  }
  (*engine)->Stop();
  return 0;
}
