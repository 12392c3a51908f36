// `dsa replay`: the trace client (one thread per in-flight Generate stream, a dispatcher keeping
// the trace's arrival times, a monitor sampling GetLoad and drawing progress) and the report's
// figures; replay_report.cc writes the report out.
#include "tools/dsa/replay.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "contracts/limits.h"
#include "coordinator/scheduler.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dsa {
namespace {

namespace v1 = ::dsa::coordinator::v1;
using Clock = std::chrono::steady_clock;

// A stream that ended OK without a Finished event (or short of its tokens) is a failure too, and
// so is one whose token ids do not match its counts or the vocabulary (a real model).
constexpr int kIncompleteStream = -1;
constexpr int kMalformedStream = -2;

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::string CodeName(int code) {
  if (code == kIncompleteStream) return "INCOMPLETE_STREAM";
  if (code == kMalformedStream) return "MALFORMED_STREAM";
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// "EOS" for FINISH_REASON_EOS.
std::string FinishReasonName(int reason) {
  std::string name = v1::FinishReason_Name(reason);
  constexpr std::string_view kPrefix = "FINISH_REASON_";
  if (name.rfind(kPrefix, 0) == 0) name = name.substr(kPrefix.size());
  return name.empty() ? absl::StrCat(reason) : name;
}

// Runs one request's Generate stream to its end and records what it streamed. `vocab_size`: a
// real model's (its token ids are checked against it), 0 for the pattern model.
void RunOne(v1::CoordinatorService::Stub& stub, const TraceRequest& request, int64_t index,
            const ReplayOptions& options, int32_t vocab_size, grpc::ClientContext& context,
            RequestRecord& record) {
  v1::GenerateRequest generate;
  generate.set_request_id(absl::StrCat("replay-", index));
  if (options.tokens != nullptr) {
    const std::vector<int32_t> ids = options.tokens->Context(request, index);
    generate.mutable_context_tokens()->mutable_tokens()->Assign(ids.begin(), ids.end());
    if (index < options.sample_outputs) {
      const size_t tail = std::min<size_t>(ids.size(), kSampleContextTailTokens);
      record.context_tail_ids.assign(ids.end() - static_cast<std::ptrdiff_t>(tail), ids.end());
    }
    const ReplaySampling& sampling = options.sampling;
    if (sampling.temperature > 0) {
      v1::SamplingParams* params = generate.mutable_sampling();
      params->set_temperature(sampling.temperature);
      params->set_top_p(sampling.top_p);
      params->set_seed(sampling.seed + static_cast<uint64_t>(index));
    }
    generate.set_ignore_eos(sampling.ignore_eos);
  } else {
    generate.set_context_length(request.context_tokens);
    for (uint64_t id : request.prefix_block_ids) generate.add_prefix_block_ids(id);
  }
  generate.set_max_new_tokens(request.output_tokens);
  generate.set_draft_length(options.draft_length);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(options.request_timeout_ms));
  const Clock::time_point sent = Clock::now();
  Clock::time_point last_tokens = sent;
  bool finished = false;
  std::string malformed;  // the first event that broke the token contract
  std::unique_ptr<grpc::ClientReader<v1::GenerateEvent>> reader = stub.Generate(&context, generate);
  v1::GenerateEvent event;
  while (reader->Read(&event)) {
    const Clock::time_point now = Clock::now();
    if (event.has_admitted()) {
      record.admitted = true;
      record.prefix_slots_reused = event.admitted().prefix_slots_reused();
    } else if (event.has_tokens()) {
      const v1::Tokens& tokens = event.tokens();
      if (record.ttft_seconds < 0) {
        record.ttft_seconds = SecondsBetween(sent, now);
      } else if (tokens.count() > 0) {
        record.inter_token_seconds.push_back(SecondsBetween(last_tokens, now) / tokens.count());
      }
      last_tokens = now;
      record.generated_tokens += tokens.count();
      record.drafted_tokens += tokens.drafted();
      record.accepted_tokens += tokens.accepted();
      record.blocks_scored += tokens.blocks_scored();
      record.blocks_visible += tokens.blocks_visible();
      record.audited_rows += tokens.audited_rows();
      record.audit_miss_rate_sum += tokens.audit_miss_rate_sum();
      record.selection_wait_seconds.emplace_back(tokens.selection_wait_seconds().begin(),
                                                 tokens.selection_wait_seconds().end());
      if (vocab_size > 0) {
        record.token_ids.insert(record.token_ids.end(), tokens.token_ids().begin(),
                                tokens.token_ids().end());
        if (malformed.empty() && tokens.token_ids_size() != tokens.count()) {
          malformed =
              absl::StrCat("a Tokens event at position ", tokens.first_position(), " counts ",
                           tokens.count(), " tokens but carries ", tokens.token_ids_size(), " ids");
        }
        for (int32_t id : tokens.token_ids()) {
          if (malformed.empty() && (id < 0 || id >= vocab_size)) {
            malformed = absl::StrCat("token id ", id, " at position ", tokens.first_position(),
                                     " is outside the vocabulary [0, ", vocab_size, ")");
          }
        }
      }
    } else if (event.has_finished()) {
      finished = true;
      record.migrations = event.finished().migrations();
      record.finish_reason = FinishReasonName(event.finished().finish_reason());
      if (event.finished().has_stop_token_id()) {
        record.stop_token_id = event.finished().stop_token_id();
      }
    }
  }
  const grpc::Status status = reader->Finish();
  record.status_code = static_cast<int>(status.error_code());
  record.error = status.error_message();
  // A real model may end early, at its end-of-sequence or a stop token.
  const bool ended_by_token = record.finish_reason == "EOS" || record.finish_reason == "STOP_TOKEN";
  if (status.ok() && !malformed.empty()) {
    record.status_code = kMalformedStream;
    record.error = malformed;
  } else if (status.ok() &&
             (!finished || (record.generated_tokens < request.output_tokens && !ended_by_token))) {
    record.status_code = kIncompleteStream;
    record.error =
        absl::StrCat("stream ended OK with ", record.generated_tokens, " of ",
                     request.output_tokens, " tokens", finished ? "" : " and no Finished event");
  }
}

// Work handed from the dispatcher to the stream threads.
struct Pending {
  int64_t index = 0;
  Clock::time_point arrival;
};

// The shared state of one replay.
class ReplayRun {
 public:
  ReplayRun(std::vector<TraceRequest> requests, const ReplayOptions& options)
      : requests_(std::move(requests)),
        options_(options),
        channel_(NewChannel(options.coordinator, options.security)),
        stub_(v1::CoordinatorService::NewStub(channel_)),
        records_(requests_.size()) {}

  // GetLoad: the coordinator answers, and its model fits the options (real tokens for a real
  // model only, every corpus id in its vocabulary); cuts the contexts to its max context.
  absl::Status Probe() {
    v1::GetLoadResponse load;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.set_wait_for_ready(true);
    const grpc::Status status = stub_->GetLoad(&context, v1::GetLoadRequest(), &load);
    if (!status.ok()) {
      return absl::UnavailableError(
          absl::StrCat("coordinator ", options_.coordinator,
                       " did not answer GetLoad: ", status.error_message()));
    }
    model_ = load.model();
    const bool real_model = model_.vocab_size() > 0;
    if (real_model && options_.tokens == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator ", options_.coordinator, " serves the real model ", model_.name(),
          ", which needs token ids: replay with --model smollm2 (real text contexts)"));
    }
    if (options_.tokens != nullptr && load.has_model() && !real_model) {
      return absl::FailedPreconditionError(
          absl::StrCat("coordinator ", options_.coordinator, " serves the ",
                       model_.name().empty() ? std::string("pattern") : model_.name(),
                       " model, which draws no tokens: replay it without --model smollm2"));
    }
    if (real_model && options_.tokens->max_token() >= model_.vocab_size()) {
      return absl::FailedPreconditionError(
          absl::StrCat(options_.token_file, " holds token id ", options_.tokens->max_token(),
                       ", beyond the vocabulary of ", model_.name(), " (", model_.vocab_size(),
                       " ids): a token file of another tokenizer?"));
    }
    if (real_model) contexts_cut_ = FitToModelContext(requests_, model_.max_context());
    return absl::OkStatus();
  }

  ReplayReport Run() {
    start_ = Clock::now();
    std::vector<std::thread> workers;
    const int num_workers =
        static_cast<int>(std::min<int64_t>(options_.max_in_flight, requests_.size()));
    workers.reserve(num_workers);
    for (int i = 0; i < num_workers; ++i) workers.emplace_back([this] { Work(); });
    std::thread monitor([this] { Monitor(); });
    Dispatch();
    for (std::thread& worker : workers) worker.join();
    const double wall_seconds = SecondsBetween(start_, Clock::now());
    // A stop leaves the requests never dispatched: each fails as never sent (not as completed).
    for (size_t i = 0; i < records_.size(); ++i) {
      RequestRecord& record = records_[i];
      if (record.sent || record.status_code != 0) continue;
      record.index = static_cast<int64_t>(i);
      record.status_code = static_cast<int>(grpc::StatusCode::CANCELLED);
      record.error = "replay stopped before sending";
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_monitor_.notify_all();
    monitor.join();
    Sample();
    ReplayReport report = AggregateReplay(records_, samples_, wall_seconds, options_);
    report.prefix_slots_reusable = ReusablePrefixSlots(requests_);
    report.stopped = StopRequested();
    report.model_name = model_.name();
    report.vocab_size = model_.vocab_size();
    report.model_max_context = model_.max_context();
    report.contexts_cut_to_model = contexts_cut_;
    return report;
  }

 private:
  bool StopRequested() const { return options_.stop != nullptr && options_.stop->load(); }

  // Hands each request to the stream threads at its (scaled) arrival time.
  void Dispatch() {
    for (size_t i = 0; i < requests_.size(); ++i) {
      const auto offset = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
          static_cast<double>(requests_[i].arrival_ms) * options_.time_scale / 1000.0));
      const Clock::time_point arrival = start_ + offset;
      std::unique_lock<std::mutex> lock(mutex_);
      // Sleep until the arrival time, waking early only to stop.
      wake_dispatcher_.wait_until(lock, arrival, [this] { return StopRequested(); });
      if (StopRequested()) break;
      queue_.push_back({static_cast<int64_t>(i), arrival});
      wake_workers_.notify_one();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    dispatch_done_ = true;
    wake_workers_.notify_all();
  }

  // One stream thread: runs queued requests one at a time.
  void Work() {
    while (true) {
      Pending pending;
      grpc::ClientContext context;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_workers_.wait(lock, [this] { return !queue_.empty() || dispatch_done_; });
        if (queue_.empty()) return;
        pending = queue_.front();
        queue_.pop_front();
        if (StopRequested()) {
          records_[pending.index].index = pending.index;
          records_[pending.index].status_code = static_cast<int>(grpc::StatusCode::CANCELLED);
          records_[pending.index].error = "replay stopped before sending";
          ++failed_;
          continue;
        }
        contexts_.insert(&context);
        ++in_flight_;
      }
      RequestRecord& record = records_[pending.index];
      const TraceRequest& request = requests_[pending.index];
      record.index = pending.index;
      record.context_tokens = request.context_tokens;
      record.max_new_tokens = request.output_tokens;
      record.client_wait_seconds = SecondsBetween(pending.arrival, Clock::now());
      record.sent = true;
      RunOne(*stub_, request, pending.index, options_, model_.vocab_size(), context, record);
      std::lock_guard<std::mutex> lock(mutex_);
      contexts_.erase(&context);
      --in_flight_;
      ++(record.status_code == 0 ? completed_ : failed_);
    }
  }

  void Sample() {
    v1::GetLoadResponse load;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    if (!stub_->GetLoad(&context, v1::GetLoadRequest(), &load).ok()) return;
    CacheSample sample;
    sample.seconds = SecondsBetween(start_, Clock::now());
    sample.cache_blocks_used = load.cache_blocks_used();
    sample.cache_blocks_capacity = load.cache_blocks_capacity();
    sample.queued = load.queued();
    sample.running = load.running();
    samples_.push_back(sample);
  }

  void DrawProgress(bool tty, bool last) {
    long long completed = 0, failed = 0, in_flight = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      completed = completed_;
      failed = failed_;
      in_flight = in_flight_;
    }
    const auto total = static_cast<long long>(requests_.size());
    const long long finished = completed + failed;
    const double elapsed = SecondsBetween(start_, Clock::now());
    if (tty) {
      constexpr int kWidth = 30;
      const int filled = total == 0 ? kWidth : static_cast<int>(kWidth * finished / total);
      std::fprintf(options_.progress,
                   "\r[%s%s] %lld/%lld done, %lld failed, %lld in flight, %.1f s",
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                   finished, total, failed, in_flight, elapsed);
      if (last) std::fputc('\n', options_.progress);
    } else {
      std::fprintf(options_.progress,
                   "dsa replay: %lld/%lld done (%lld completed, %lld failed), %lld in flight, "
                   "%.1f s\n",
                   finished, total, completed, failed, in_flight, elapsed);
    }
    std::fflush(options_.progress);
  }

  // Samples GetLoad every sample_ms, draws progress, and cancels streams when asked to stop.
  void Monitor() {
    const bool tty = options_.progress != nullptr && isatty(fileno(options_.progress)) == 1;
    const auto progress_period =
        std::chrono::milliseconds(tty ? 200 : std::max(options_.progress_period_ms, 1));
    const auto sample_period = std::chrono::milliseconds(std::max(options_.sample_ms, 1));
    Clock::time_point next_sample = Clock::now();
    Clock::time_point next_progress = Clock::now() + progress_period;
    bool cancelled = false;
    while (true) {
      const Clock::time_point now = Clock::now();
      if (now >= next_sample) {
        Sample();
        next_sample += sample_period;
        if (next_sample < now) next_sample = now + sample_period;
      }
      if (options_.progress != nullptr && now >= next_progress) {
        DrawProgress(tty, false);
        next_progress = now + progress_period;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      if (StopRequested() && !cancelled) {
        cancelled = true;
        for (grpc::ClientContext* context : contexts_) context->TryCancel();
        wake_dispatcher_.notify_all();
      }
      if (done_) break;
      const Clock::time_point wake =
          std::min({next_sample, next_progress, Clock::now() + std::chrono::milliseconds(100)});
      wake_monitor_.wait_until(lock, wake, [this] { return done_; });
      if (done_) break;
    }
    if (options_.progress != nullptr) DrawProgress(tty, true);
  }

  std::vector<TraceRequest> requests_;  // cut to the model's max context by Probe
  const ReplayOptions& options_;
  v1::Model model_;           // the coordinator's, from Probe
  int64_t contexts_cut_ = 0;  // by Probe
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  Clock::time_point start_;
  std::vector<RequestRecord> records_;  // one per request; each written by one stream thread
  std::vector<CacheSample> samples_;    // written by the monitor, then by Run after it joined

  std::mutex mutex_;
  std::condition_variable wake_workers_, wake_dispatcher_, wake_monitor_;
  std::deque<Pending> queue_;
  std::set<grpc::ClientContext*> contexts_;  // streams in flight, for cancelling
  bool dispatch_done_ = false;
  bool done_ = false;
  int64_t in_flight_ = 0, completed_ = 0, failed_ = 0;
};

double Mean(const std::vector<double>& values) {
  if (values.empty()) return 0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

// SplitMix64's finalizer (Steele, Lea and Flood 2014): a well-mixed 64-bit hash of `x`.
uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

ContextTokenSource::ContextTokenSource(std::vector<int32_t> tokens) : tokens_(std::move(tokens)) {
  for (int32_t id : tokens_) max_token_ = std::max(max_token_, id);
}

absl::StatusOr<ContextTokenSource> ContextTokenSource::Create(std::vector<int32_t> tokens) {
  if (static_cast<int64_t>(tokens.size()) < kPrefixBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("the token corpus holds ", tokens.size(),
                                                   " ids; real-text contexts need at least ",
                                                   kPrefixBlockTokens, " (one block)"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the token corpus holds the negative id ", tokens[i], " at ", i));
    }
  }
  return ContextTokenSource(std::move(tokens));
}

int64_t ContextTokenSource::BlockOffset(uint64_t id) const {
  const auto modulus = static_cast<uint64_t>(num_offsets());
  const unsigned __int128 product =
      static_cast<unsigned __int128>(id % modulus) * (kOffsetMultiplier % modulus);
  return static_cast<int64_t>(product % modulus);
}

int64_t ContextTokenSource::UnsharedBlockOffset(int64_t index, int64_t block) const {
  const uint64_t key =
      Mix64(static_cast<uint64_t>(index) * 0x100000001B3ULL ^ Mix64(static_cast<uint64_t>(block)));
  return static_cast<int64_t>(key % static_cast<uint64_t>(num_offsets()));
}

std::vector<int32_t> ContextTokenSource::Context(const TraceRequest& request, int64_t index) const {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(std::max<int64_t>(request.context_tokens, 0)));
  for (int64_t block = 0; block * kPrefixBlockTokens < request.context_tokens; ++block) {
    const int64_t offset = block < static_cast<int64_t>(request.prefix_block_ids.size())
                               ? BlockOffset(request.prefix_block_ids[static_cast<size_t>(block)])
                               : UnsharedBlockOffset(index, block);
    const int64_t length =
        std::min<int64_t>(kPrefixBlockTokens, request.context_tokens - block * kPrefixBlockTokens);
    ids.insert(ids.end(), tokens_.begin() + offset, tokens_.begin() + offset + length);
  }
  return ids;
}

int64_t FitToModelContext(std::vector<TraceRequest>& requests, int64_t max_context) {
  if (max_context <= 1) return 0;
  int64_t cut = 0;
  for (TraceRequest& request : requests) {
    request.output_tokens = std::min(request.output_tokens, max_context - 1);
    if (request.context_tokens + request.output_tokens <= max_context) continue;
    request.context_tokens = max_context - request.output_tokens;
    const auto max_ids =
        static_cast<size_t>((request.context_tokens + kPrefixBlockTokens - 1) / kPrefixBlockTokens);
    if (request.prefix_block_ids.size() > max_ids) request.prefix_block_ids.resize(max_ids);
    ++cut;
  }
  return cut;
}

int64_t ReusablePrefixSlots(const std::vector<TraceRequest>& requests) {
  absl::flat_hash_set<uint64_t> seen;  // ids of whole blocks of earlier prompts
  int64_t reusable = 0;
  for (const TraceRequest& request : requests) {
    size_t run = 0;
    while (run < request.prefix_block_ids.size() && seen.contains(request.prefix_block_ids[run])) {
      ++run;
    }
    reusable += SharedPrefixSlots(static_cast<int64_t>(run), request.context_tokens);
    const size_t whole = std::min(static_cast<size_t>(request.context_tokens / kPrefixBlockTokens),
                                  request.prefix_block_ids.size());
    seen.insert(request.prefix_block_ids.begin(), request.prefix_block_ids.begin() + whole);
  }
  return reusable;
}

std::vector<TraceRequest> ApplyCaps(std::vector<TraceRequest> requests, const ReplayCaps& caps) {
  if (caps.limit > 0 && static_cast<int64_t>(requests.size()) > caps.limit) {
    requests.resize(caps.limit);
  }
  for (TraceRequest& request : requests) {
    if (caps.max_context > 0 && request.context_tokens > caps.max_context) {
      request.context_tokens = caps.max_context;
    }
    const auto max_ids =
        static_cast<size_t>((request.context_tokens + kPrefixBlockTokens - 1) / kPrefixBlockTokens);
    if (request.prefix_block_ids.size() > max_ids) request.prefix_block_ids.resize(max_ids);
    if (caps.max_output > 0 && request.output_tokens > caps.max_output) {
      request.output_tokens = caps.max_output;
    }
  }
  return requests;
}

double NearestRankPercentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto n = static_cast<double>(values.size());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * n));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

ReplayReport AggregateReplay(const std::vector<RequestRecord>& records,
                             const std::vector<CacheSample>& samples, double wall_seconds,
                             const ReplayOptions& options) {
  ReplayReport report;
  report.caps = options.caps;
  report.time_scale = options.time_scale;
  report.max_in_flight = options.max_in_flight;
  report.draft_length = options.draft_length;
  report.real_tokens = options.tokens != nullptr;
  if (report.real_tokens) {
    report.token_file = options.token_file;
    report.sampling = options.sampling;
  }
  report.requests = static_cast<int64_t>(records.size());
  report.wall_seconds = wall_seconds;

  std::vector<double> ttft, itl, client_wait;
  std::vector<std::vector<double>> waits_by_layer;
  for (const RequestRecord& record : records) {
    if (record.status_code == 0) {
      ++report.completed;
      if (!record.finish_reason.empty()) ++report.finish_reasons[record.finish_reason];
      if (record.ttft_seconds >= 0) ttft.push_back(record.ttft_seconds);
      itl.insert(itl.end(), record.inter_token_seconds.begin(), record.inter_token_seconds.end());
    } else {
      ++report.failed;
      ++report.failures_by_code[CodeName(record.status_code)];
      if (report.first_error.empty()) {
        report.first_error = absl::StrCat("request ", record.index, ": ",
                                          CodeName(record.status_code), ": ", record.error);
      }
    }
    client_wait.push_back(record.client_wait_seconds);
    report.generated_tokens += record.generated_tokens;
    report.migrations += record.migrations;
    report.migrated_requests += record.migrations > 0 ? 1 : 0;
    report.blocks_scored += record.blocks_scored;
    report.blocks_visible += record.blocks_visible;
    report.audited_rows += record.audited_rows;
    report.audit_miss_rate_sum += record.audit_miss_rate_sum;
    report.drafted_tokens += record.drafted_tokens;
    report.accepted_tokens += record.accepted_tokens;
    if (record.admitted) {
      report.prefix_slots_reused += record.prefix_slots_reused;
      report.context_slots += record.context_tokens;
    }
    for (const std::vector<double>& step : record.selection_wait_seconds) {
      if (step.size() > waits_by_layer.size()) waits_by_layer.resize(step.size());
      for (size_t layer = 0; layer < step.size(); ++layer) {
        waits_by_layer[layer].push_back(step[layer]);
      }
    }
  }
  if (report.real_tokens) {
    for (const RequestRecord& record : records) {
      if (record.index >= options.sample_outputs) continue;
      OutputSample sample;
      sample.index = record.index;
      sample.context_tokens = record.context_tokens;
      sample.context_tail_ids = record.context_tail_ids;
      sample.token_ids = record.token_ids;
      sample.finish_reason = record.finish_reason;
      sample.status = record.status_code == 0 ? "OK" : CodeName(record.status_code);
      report.samples.push_back(std::move(sample));
    }
    std::sort(report.samples.begin(), report.samples.end(),
              [](const OutputSample& a, const OutputSample& b) { return a.index < b.index; });
  }
  report.ttft_p50 = NearestRankPercentile(ttft, 50);
  report.ttft_p99 = NearestRankPercentile(ttft, 99);
  report.itl_p50 = NearestRankPercentile(itl, 50);
  report.itl_p99 = NearestRankPercentile(itl, 99);
  report.itl_max = itl.empty() ? 0 : *std::max_element(itl.begin(), itl.end());
  report.client_wait_mean = Mean(client_wait);
  report.client_wait_max =
      client_wait.empty() ? 0 : *std::max_element(client_wait.begin(), client_wait.end());
  report.decode_tokens_per_second =
      wall_seconds > 0 ? static_cast<double>(report.generated_tokens) / wall_seconds : 0;
  report.realized_block_sparsity = report.blocks_visible > 0
                                       ? 1.0 - static_cast<double>(report.blocks_scored) /
                                                   static_cast<double>(report.blocks_visible)
                                       : 0;
  report.audited_miss_rate = report.audited_rows > 0 ? report.audit_miss_rate_sum /
                                                           static_cast<double>(report.audited_rows)
                                                     : -1;
  report.prefix_reuse_fraction = report.context_slots > 0
                                     ? static_cast<double>(report.prefix_slots_reused) /
                                           static_cast<double>(report.context_slots)
                                     : 0;
  report.spec_acceptance =
      report.drafted_tokens > 0
          ? static_cast<double>(report.accepted_tokens) / static_cast<double>(report.drafted_tokens)
          : 0;
  report.cache_samples = samples;
  if (!samples.empty()) {
    std::vector<double> used;
    used.reserve(samples.size());
    for (const CacheSample& sample : samples) {
      used.push_back(static_cast<double>(sample.cache_blocks_used));
    }
    report.cache_used_min = *std::min_element(used.begin(), used.end());
    report.cache_used_max = *std::max_element(used.begin(), used.end());
    report.cache_used_mean = Mean(used);
    report.cache_capacity = samples.back().cache_blocks_capacity;
  }
  for (size_t layer = 0; layer < waits_by_layer.size(); ++layer) {
    LayerWait wait;
    wait.layer = static_cast<int>(layer);
    wait.steps = static_cast<int64_t>(waits_by_layer[layer].size());
    wait.mean_seconds = Mean(waits_by_layer[layer]);
    wait.p99_seconds = NearestRankPercentile(waits_by_layer[layer], 99);
    report.selection_wait.push_back(wait);
  }
  return report;
}

absl::StatusOr<ReplayReport> RunReplay(const std::vector<TraceRequest>& requests,
                                       const ReplayOptions& options) {
  if (options.coordinator.empty()) return absl::InvalidArgumentError("no coordinator address");
  if (options.max_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-in-flight must be >= 1, not ", options.max_in_flight));
  }
  if (!(options.time_scale >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--time-scale must be >= 0, not ", options.time_scale));
  }
  if (options.draft_length < 0 || options.draft_length > kMaxDraftLength) {
    return absl::InvalidArgumentError(absl::StrCat("--draft-length must be in 0..", kMaxDraftLength,
                                                   ", not ", options.draft_length));
  }
  if (options.sample_ms < 1 || options.request_timeout_ms < 1) {
    return absl::InvalidArgumentError("--sample-ms and the request timeout must be >= 1 ms");
  }
  if (options.sample_outputs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sample-outputs must be >= 0, not ", options.sample_outputs));
  }
  const ReplaySampling& sampling = options.sampling;
  if (!(sampling.temperature >= 0 && sampling.temperature <= 100) ||
      !(sampling.top_p >= 0 && sampling.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--temperature must be in [0, 100] and --top-p in [0, 1], not ",
                     sampling.temperature, " and ", sampling.top_p));
  }
  ReplayRun run(requests, options);
  if (absl::Status reachable = run.Probe(); !reachable.ok()) return reachable;
  return run.Run();
}

}  // namespace dsa
