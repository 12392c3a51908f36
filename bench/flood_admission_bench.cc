// bench_flood_admission: how long another caller's request waits to be admitted while one caller
// floods the coordinator (docs/reliability.md, "Fair admission"). CoordinatorEngine runs with its
// threads over in-memory workers (tests/coordinator/fake_workers.h) and the real clock; --streams
// threads of one caller ("peer:flood") each send Generate after Generate for --seconds, reading
// every event --read-delay-ms late (slow readers that hold their slots for their whole
// max_new_tokens) and retrying 20 ms after a refusal; one neighbour ("peer:neighbour") sends a
// request every --neighbour-interval-ms and reads at once. Prints one JSON object: the
// neighbour's admission waits (from its Generate to its Admitted event) and refusals, and the
// flood's outcomes. --fifo turns the per-caller limits off (the queue's order alone).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "tests/coordinator/fake_workers.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kAttention[] = "10.0.0.1:7000";
constexpr char kIndexer[] = "10.0.1.1:7100";

// A client stream that reads each event `read_delay` late and notes when Admitted arrived.
class ClientStream final : public dsa::GenerateStream {
 public:
  explicit ClientStream(std::chrono::milliseconds read_delay) : read_delay_(read_delay) {}
  bool Write(const dsa::GenerateEvent& event) override {
    if (std::holds_alternative<dsa::AdmittedEvent>(event)) admitted_at_ = Clock::now();
    if (read_delay_.count() > 0) std::this_thread::sleep_for(read_delay_);
    return !cancelled_.load();
  }
  bool IsCancelled() override { return cancelled_.load(); }
  void TryCancel() override { cancelled_ = true; }
  std::optional<Clock::time_point> admitted_at() const { return admitted_at_; }

 private:
  const std::chrono::milliseconds read_delay_;
  std::atomic<bool> cancelled_{false};
  std::optional<Clock::time_point> admitted_at_;  // written by the handler's thread only
};

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(q * values.size()));
  return values[i];
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 and json errors end
                                   // the run.
  CLI::App app{"bench_flood_admission: a neighbour's admission wait under one caller's flood"};
  int streams = 2000;
  double seconds = 10.0;
  int max_new_tokens = 64;
  int read_delay_ms = 10;
  int neighbour_interval_ms = 250;
  bool fifo = false;
  app.add_option("--streams", streams, "Concurrent Generate streams of the flooding caller")
      ->capture_default_str();
  app.add_option("--seconds", seconds, "How long the flood lasts")->capture_default_str();
  app.add_option("--max-new-tokens", max_new_tokens, "Tokens of each request")
      ->capture_default_str();
  app.add_option("--read-delay-ms", read_delay_ms, "The flood's readers read each event this late")
      ->capture_default_str();
  app.add_option("--neighbour-interval-ms", neighbour_interval_ms,
                 "The neighbour sends one request this often")
      ->capture_default_str();
  app.add_flag("--fifo", fifo, "Per-caller limits off (max_*_per_caller 0)");
  CLI11_PARSE(app, argc, argv);

  auto workers = std::make_shared<dsa::testing::FakeWorkers>();
  workers->AddAttention(kAttention);
  workers->AddIndexer(kIndexer);
  dsa::CoordinatorOptions options;
  options.attention_addresses = {kAttention};
  options.indexer_addresses = {kIndexer};
  options.worker_check_interval_ms = 0;
  options.retain_finished = false;
  if (fifo) {
    options.max_queued_per_caller = 0;
    options.max_running_per_caller = 0;
  }
  prometheus::Registry registry;
  dsa::CoordinatorMetrics metrics(registry);
  auto engine = dsa::CoordinatorEngine::Create(options, &metrics, workers);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }

  const Clock::time_point end =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  std::atomic<int64_t> flood_completed{0}, flood_refused{0}, flood_other{0}, ids{0};
  std::vector<std::thread> flood;
  flood.reserve(streams);
  for (int i = 0; i < streams; ++i) {
    flood.emplace_back([&] {
      while (Clock::now() < end) {
        dsa::GenerateSpec request;
        request.request_id = "flood-" + std::to_string(ids.fetch_add(1));
        request.context_length = 256;
        request.max_new_tokens = max_new_tokens;
        ClientStream stream{std::chrono::milliseconds(read_delay_ms)};
        const absl::Status status = (*engine)->Generate(request, "peer:flood", "", stream);
        if (status.ok()) {
          ++flood_completed;
        } else if (status.code() == absl::StatusCode::kResourceExhausted) {
          ++flood_refused;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        } else {
          ++flood_other;
        }
      }
    });
  }

  std::vector<double> waits;
  int neighbour_refused = 0, neighbour_failed = 0;
  std::string first_error;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the flood fills its shares
  for (int n = 0; Clock::now() + std::chrono::milliseconds(neighbour_interval_ms) < end; ++n) {
    dsa::GenerateSpec request;
    request.request_id = "neighbour-" + std::to_string(n);
    request.context_length = 256;
    request.max_new_tokens = 8;
    ClientStream stream{std::chrono::milliseconds(0)};
    const Clock::time_point sent = Clock::now();
    const absl::Status status = (*engine)->Generate(request, "peer:neighbour", "", stream);
    if (stream.admitted_at().has_value()) {
      waits.push_back(std::chrono::duration<double>(*stream.admitted_at() - sent).count());
    }
    if (status.code() == absl::StatusCode::kResourceExhausted) ++neighbour_refused;
    if (!status.ok() && status.code() != absl::StatusCode::kResourceExhausted) ++neighbour_failed;
    if (!status.ok() && first_error.empty()) first_error = status.ToString();
    std::this_thread::sleep_until(sent + std::chrono::milliseconds(neighbour_interval_ms));
  }
  for (std::thread& t : flood) t.join();
  (*engine)->Stop();

  nlohmann::json report = {
      {"mode", fifo ? "no per-caller limits" : "per-caller limits (defaults)"},
      {"flood_streams", streams},
      {"seconds", seconds},
      {"max_new_tokens", max_new_tokens},
      {"read_delay_ms", read_delay_ms},
      {"neighbour",
       {{"admitted", waits.size()},
        {"refused", neighbour_refused},
        {"failed", neighbour_failed},
        {"first_error", first_error},
        {"admission_wait_s",
         {{"p50", Percentile(waits, 0.5)},
          {"p99", Percentile(waits, 0.99)},
          {"max", waits.empty() ? 0.0 : *std::max_element(waits.begin(), waits.end())}}}}},
      {"flood",
       {{"completed", flood_completed.load()},
        {"refused", flood_refused.load()},
        {"other", flood_other.load()}}}};
  std::printf("%s\n", report.dump(2).c_str());
  return 0;
}
