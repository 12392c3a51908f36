// Tests of the `dsa-attention` binary as a real process on loopback (port 0), beside a real
// `dsa-indexer`: --help, exit code 2 on a bad model config, health, reflection, a prefill and
// decode steps through both processes, /metrics, and a clean exit on SIGTERM.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsa/attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"

namespace {

namespace av1 = ::dsa::attention::v1;

using dsa::testing::HealthStatus;
using dsa::testing::HttpGetMetrics;
using dsa::testing::Process;
using dsa::testing::ReflectionListServices;
using dsa::testing::WaitExit;

// Runs `command` (stderr joined to stdout); returns its output and sets *exit_code.
std::string RunCommand(const std::string& command, int* exit_code) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string text;
  char buffer[512];
  while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
  const int status = pipe != nullptr ? pclose(pipe) : -1;
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return text;
}

TEST(DsaAttentionBinaryTest, HelpListsTheFlags) {
  int exit_code = -1;
  const std::string text = RunCommand(std::string(DSA_ATTENTION_BINARY) + " --help", &exit_code);
  EXPECT_EQ(exit_code, 0);
  for (const char* flag :
       {"--listen", "--metrics-listen", "--shutdown-grace-ms", "--drain-delay-ms",
        "--layer-pattern", "--retention", "--num-model-layers", "--lag-depth", "--num-heads",
        "--head-dim", "--kv-dim", "--attention-heads", "--kv-capacity-slots", "--seed"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
}

TEST(DsaAttentionBinaryTest, BadModelConfigExitsWithTwoAndSaysWhy) {
  int exit_code = -1;
  std::string text =
      RunCommand(std::string(DSA_ATTENTION_BINARY) + " --layer-pattern SFSF", &exit_code);
  EXPECT_EQ(exit_code, 2);
  EXPECT_NE(text.find("\"msg\":\"bad model config\""), std::string::npos) << text;
  EXPECT_NE(text.find("starts with a shared layer"), std::string::npos) << text;
  text = RunCommand(std::string(DSA_ATTENTION_BINARY) + " --retention 2", &exit_code);
  EXPECT_EQ(exit_code, 2);
  EXPECT_NE(text.find("--num-model-layers"), std::string::npos) << text;
  text = RunCommand(std::string(DSA_ATTENTION_BINARY) + " --head-dim 12", &exit_code);
  EXPECT_EQ(exit_code, 2);
  EXPECT_NE(text.find("head_dim"), std::string::npos) << text;
}

// Bad transport or device configuration fails at start with exit code 2 and says which flag and
// why; nothing is served.
TEST(DsaAttentionBinaryTest, BadTransportOrDeviceConfigExitsWithTwoAndSaysWhy) {
  const std::string binary = DSA_ATTENTION_BINARY;
  struct Case {
    std::string flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"--indexer-device cuda", "--indexer-device configures the co-located indexer"},
      {"--indexer-capacity-blocks 10", "it needs --transport inprocess"},
      {"--attention-cuda-device 1", "--attention-cuda-device needs --attention-device cuda"},
      {"--transport nccl-over-carrier-pigeon", "--transport"},
      {"--transport inprocess --indexer-cuda-device 1",
       "--indexer-cuda-device is a GPU flag: it needs --indexer-device cuda"},
      {"--transport inprocess --indexer-capacity-blocks -1", "capacity"},
      {"--layer-standin true", "--layer-standin needs --attention-device cuda"},
      {"--layer-standin-busy-us 5", "--layer-standin-busy-us needs --attention-device cuda"},
      {"--attention-device cuda --layer-standin-weight-bytes 1000000",
       "--layer-standin-weight-bytes needs --layer-standin true"},
  };
  for (const Case& c : cases) {
    int exit_code = -1;
    const std::string text = RunCommand(binary + " " + c.flags, &exit_code);
    EXPECT_NE(exit_code, 0) << c.flags;
    EXPECT_NE(text.find(c.says), std::string::npos) << c.flags << ":\n" << text;
    EXPECT_EQ(text.find("listening on"), std::string::npos) << c.flags;
  }
  // An attention GPU that is not there (none at all, one too many, or no CUDA in the build) is
  // refused at start, with the reason.
  int exit_code = -1;
  const std::string text =
      RunCommand(binary + " --attention-device cuda --attention-cuda-device 4096", &exit_code);
  EXPECT_EQ(exit_code, 2) << text;
  EXPECT_TRUE(text.find("cannot use the attention GPU") != std::string::npos ||
              text.find("built without CUDA") != std::string::npos)
      << text;
  EXPECT_EQ(text.find("listening on"), std::string::npos) << text;
}

TEST(DsaAttentionBinaryTest, ServesStepsAgainstARealIndexerThenExitsOnSigterm) {
  const Process indexer = dsa::testing::StartServer(
      DSA_INDEXER_BINARY, {"--capacity-blocks", "256", "--num-heads", "8", "--head-dim", "32"});
  ASSERT_FALSE(indexer.address.empty());
  const Process attention = dsa::testing::StartServer(
      DSA_ATTENTION_BINARY,
      {"--retention", "2", "--num-model-layers", "6", "--num-heads", "8", "--head-dim", "32",
       "--kv-capacity-slots", "10000", "--shutdown-grace-ms", "500"});
  ASSERT_FALSE(attention.address.empty());
  auto channel = grpc::CreateChannel(attention.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(HealthStatus(channel, "readiness"), 1);
  const std::string services = ReflectionListServices(channel);
  EXPECT_NE(services.find("dsa.attention.v1.AttentionService"), std::string::npos) << services;

  auto stub = av1::AttentionService::NewStub(channel);
  {
    grpc::ClientContext context;
    av1::GetInfoResponse info;
    ASSERT_TRUE(stub->GetInfo(&context, av1::GetInfoRequest(), &info).ok());
    EXPECT_EQ(info.num_model_layers(), 6);
    EXPECT_EQ(info.num_full_layers(), 3);
    EXPECT_EQ(info.lag_depth(), 1);
    EXPECT_EQ(info.num_heads(), 8);
    EXPECT_EQ(info.head_dim(), 32);
    EXPECT_EQ(info.kv_capacity_slots(), 10000);
  }
  {
    grpc::ClientContext context;
    av1::PrefillRequest request;
    request.set_sequence_id(1);
    request.set_context_length(1000);
    request.add_prefix_block_ids(42);
    request.set_indexer_worker(indexer.address);
    request.mutable_settings()->set_top_k(64);
    av1::PrefillResponse response;
    const grpc::Status status = stub->Prefill(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.slots(), 1000);
  }
  for (int step = 0; step < 2; ++step) {
    grpc::ClientContext context;
    av1::DecodeStepRequest request;
    request.add_sequences()->set_sequence_id(1);
    request.mutable_sequences(0)->set_rows(1);
    av1::DecodeStepResponse response;
    const grpc::Status status = stub->DecodeStep(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.sequences(0).first_position(), 1000 + step);
    EXPECT_EQ(response.selection_wait_seconds_size(), 6);
  }

  ASSERT_FALSE(attention.metrics_address.empty());
  const std::string metrics = HttpGetMetrics(attention.metrics_address);
  for (const char* sample :
       {"dsa_attention_selection_wait_seconds_count{layer=\"5\"} 2",
        "dsa_attention_decode_step_duration_seconds_count 2",
        "dsa_attention_prefill_duration_seconds_count 1",
        "dsa_attention_kv_slots{state=\"used\"} 1002",
        "dsa_attention_kv_slots{state=\"free\"} 8998", "dsa_attention_sequences 1",
        "dsa_attention_full_layer_selects_total{form=\"host\"} 6",
        "dsa_attention_full_layer_selects_total{form=\"device\"} 0"}) {
    EXPECT_NE(metrics.find(sample), std::string::npos) << sample << "\n" << metrics;
  }

  // SIGTERM with a selection stream open to the indexer: a clean exit (the stream closed after
  // the server stopped), within the 0.5 s grace plus slack.
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(attention.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(attention.pid, std::chrono::seconds(10)), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ASSERT_EQ(kill(indexer.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(indexer.pid, std::chrono::seconds(10)), 0);
}

// On a GPU (skipped without one, or in a build without CUDA): the cuBLAS stand-in, loaded from
// its module after /metrics started, runs as the rest of each layer; /metrics still serves (it
// could not while dsa-attention linked cuBLAS), and the device-resident co-located steps run.
TEST(DsaAttentionBinaryTest, OnTheGpuTheLayerStandinLoadsAfterMetricsAndStepsRun) {
  // A CUDA build on a machine with a GPU names how many there are when asked for one too many.
  int probe_exit = -1;
  const std::string probe = RunCommand(
      std::string(DSA_ATTENTION_BINARY) + " --attention-device cuda --attention-cuda-device 4096",
      &probe_exit);
  if (probe.find("does not exist (") == std::string::npos) {
    GTEST_SKIP() << "no GPU, or no CUDA in this build: " << probe;
  }
  const Process attention = dsa::testing::StartServer(
      DSA_ATTENTION_BINARY,
      {"--attention-device", "cuda", "--layer-standin", "true", "--transport", "inprocess",
       "--indexer-device", "cuda", "--retention", "2", "--num-model-layers", "4",
       "--kv-capacity-slots", "20000", "--shutdown-grace-ms", "500"});
  ASSERT_FALSE(attention.address.empty());
  auto channel = grpc::CreateChannel(attention.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "readiness"), 1);
  auto stub = av1::AttentionService::NewStub(channel);
  {
    grpc::ClientContext context;
    av1::PrefillRequest request;
    request.set_sequence_id(1);
    request.set_context_length(5000);
    request.set_indexer_worker(attention.address);
    request.mutable_settings()->set_top_k(512);
    av1::PrefillResponse response;
    const grpc::Status status = stub->Prefill(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  for (int step = 0; step < 3; ++step) {
    grpc::ClientContext context;
    av1::DecodeStepRequest request;
    request.add_sequences()->set_sequence_id(1);
    request.mutable_sequences(0)->set_rows(1);
    av1::DecodeStepResponse response;
    const grpc::Status status = stub->DecodeStep(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_FALSE(attention.metrics_address.empty());
  const std::string metrics = HttpGetMetrics(attention.metrics_address);
  EXPECT_NE(metrics.find("dsa_attention_decode_step_duration_seconds_count 3"), std::string::npos)
      << metrics;
  // 3 steps x 2 full layers, every one in device form (the co-located GPU path was taken).
  EXPECT_NE(metrics.find("dsa_attention_full_layer_selects_total{form=\"device\"} 6"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("dsa_attention_full_layer_selects_total{form=\"host\"} 0"),
            std::string::npos)
      << metrics;
  ASSERT_EQ(kill(attention.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(attention.pid, std::chrono::seconds(10)), 0);
}

}  // namespace
