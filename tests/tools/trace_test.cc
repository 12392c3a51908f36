// Tests of the trace readers: hand-written traces, every malformed line refused with its line
// number, and the real Mooncake and Azure traces the repository carries (data/traces/).
#include "tools/dsa/trace.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(MooncakeTrace, ReadsRequestsWithPrefixBlocks) {
  std::istringstream in(
      "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 5, \"hash_ids\": [0, 1, 2]}\n"
      "\n"
      "{\"timestamp\": 40, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n"
      "{\"timestamp\": 40, \"input_length\": 3, \"output_length\": 2}\n");
  auto trace = ReadMooncakeTrace(in);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 3u);
  EXPECT_EQ((*trace)[0].context_tokens, 1025);
  EXPECT_EQ((*trace)[0].output_tokens, 5);
  EXPECT_EQ((*trace)[0].prefix_block_ids, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ((*trace)[1].arrival_ms, 40);
  EXPECT_EQ((*trace)[1].prefix_block_ids, (std::vector<uint64_t>{0}));
  EXPECT_TRUE((*trace)[2].prefix_block_ids.empty());
}

TEST(MooncakeTrace, ArrivalsAreRelativeToTheFirstRequest) {
  // A trace that starts 90 s in: the replay must not idle 90 s before its first request.
  std::istringstream in(
      "{\"timestamp\": 90000, \"input_length\": 10, \"output_length\": 1}\n"
      "{\"timestamp\": 90250, \"input_length\": 10, \"output_length\": 1}\n"
      "{\"timestamp\": 90250, \"input_length\": 10, \"output_length\": 1}\n");
  auto trace = ReadMooncakeTrace(in);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 3u);
  EXPECT_EQ((*trace)[0].arrival_ms, 0);
  EXPECT_EQ((*trace)[1].arrival_ms, 250);
  EXPECT_EQ((*trace)[2].arrival_ms, 250);
  // Going backwards is still measured against the previous timestamp, not the relative time.
  std::istringstream back(
      "{\"timestamp\": 90000, \"input_length\": 10, \"output_length\": 1}\n"
      "{\"timestamp\": 100, \"input_length\": 10, \"output_length\": 1}\n");
  EXPECT_EQ(ReadMooncakeTrace(back).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TraceFile, ErrorsNameTheFile) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / "dsa_trace_test_bad.jsonl";
  {
    std::ofstream out(path);
    out << "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\nnot json\n";
  }
  const auto trace = ReadTraceFile(path.string());
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trace.status().message(), path.string() + ": trace line 2: not a JSON object");
  std::filesystem::remove(path);
}

TEST(MooncakeTrace, MalformedLinesAreInvalidArgumentNamingTheLine) {
  const char* good = "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1}\n";
  const std::vector<std::string> bad_lines = {
      "not json",
      "[1, 2]",
      "{\"input_length\": 10, \"output_length\": 1}",
      "{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1}",
      "{\"timestamp\": 5, \"input_length\": 0, \"output_length\": 1}",
      "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": \"7\"}",
      "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1, -2]}",
      "{\"timestamp\": 5, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}",
      "{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1}",  // goes backwards
  };
  for (const std::string& bad : bad_lines) {
    std::istringstream in(std::string(good) + bad + "\n");
    auto trace = ReadMooncakeTrace(in);
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(trace.status().message().find("line 2"), absl::string_view::npos) << bad;
  }
  std::istringstream empty("");
  EXPECT_EQ(ReadMooncakeTrace(empty).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AzureTrace, ReadsRelativeMilliseconds) {
  std::istringstream in(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n"
      "2023-11-16 18:15:46.6805900,374,44\n"
      "2023-11-16 18:15:50.9951690,396,109\n"
      "2023-11-16 18:16:00.0000000,1,1\n");
  auto trace = ReadAzureTrace(in);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 3u);
  EXPECT_EQ((*trace)[0].arrival_ms, 0);
  EXPECT_EQ((*trace)[1].arrival_ms, 4314);   // 50.995169 - 46.68059 = 4.314579 s
  EXPECT_EQ((*trace)[2].arrival_ms, 13319);  // 60 - 46.68059 = 13.31941 s
  EXPECT_EQ((*trace)[1].context_tokens, 396);
  EXPECT_EQ((*trace)[1].output_tokens, 109);
}

TEST(AzureTrace, MalformedRowsAreInvalidArgument) {
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  const std::string good = "2023-11-16 18:15:46.6805900,374,44\n";
  for (const std::string& bad :
       {std::string("2023-11-16 18:15:47,374"), std::string("yesterday,374,44"),
        std::string("2023-11-16 18:15:47,zero,44"), std::string("2023-11-16 18:15:47,374,0"),
        std::string("2023-11-16 18:15:40,374,44"),
        // absl::ParseTime reads these as the infinities (found by fuzz_azure_trace).
        std::string("infinite-future,374,44"), std::string("infinite-past,374,44")}) {
    std::istringstream in(header + good + bad + "\n");
    auto trace = ReadAzureTrace(in);
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(trace.status().message().find("line 3"), absl::string_view::npos) << bad;
  }
  std::istringstream no_header(good);
  EXPECT_EQ(ReadAzureTrace(no_header).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TraceFile, UnknownPathAndExtension) {
  EXPECT_EQ(ReadTraceFile("/nonexistent/trace.jsonl").status().code(), absl::StatusCode::kNotFound);
  // A readable file whose extension is neither .jsonl nor .csv.
  const std::filesystem::path other = std::filesystem::temp_directory_path() /
                                      ("dsa-trace-test-" + std::to_string(::getpid()) + ".txt");
  std::ofstream(other) << "not a trace\n";
  ASSERT_TRUE(std::filesystem::exists(other)) << other;
  EXPECT_EQ(ReadTraceFile(other.string()).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(other);
}

// The real traces, with the figures data/README.md gives for them.
TEST(TraceFile, RealTracesMatchTheirDescription) {
  const std::filesystem::path dir = DSA_TRACE_DIR;
  auto mooncake = ReadTraceFile((dir / "mooncake_conversation_trace.jsonl").string());
  ASSERT_TRUE(mooncake.ok()) << mooncake.status();
  EXPECT_EQ(mooncake->size(), 12031u);
  int64_t max_input = 0;
  for (const TraceRequest& r : *mooncake) max_input = std::max(max_input, r.context_tokens);
  EXPECT_EQ(max_input, 126195);
  auto azure = ReadTraceFile((dir / "azure_llm_2023_conv.csv").string());
  ASSERT_TRUE(azure.ok()) << azure.status();
  EXPECT_EQ(azure->size(), 19366u);
  int64_t max_context = 0;
  for (const TraceRequest& r : *azure) max_context = std::max(max_context, r.context_tokens);
  EXPECT_EQ(max_context, 14050);
}

}  // namespace
}  // namespace dsa
