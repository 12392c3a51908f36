// Tests of what every server binary shares (server/server.h, server/process_metrics.h): the
// defaults for pods, host:port validation, flags from DSA_* variables and a TOML config file with
// their precedence, --version, log levels, and the standard process metrics.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "server/flag_file.h"
#include "server/process_metrics.h"
#include "server/server.h"
#include "server/version.h"

namespace dsa {
namespace {

// A binary's flags as the three servers build them: the common ones, one scalar and one list.
struct Flags {
  ServerFlags server = DefaultServerFlags(ServerComponent::kIndexer);
  int64_t capacity_blocks = 7;
  std::vector<std::string> workers;
};

void Add(CLI::App& app, Flags& flags) {
  AddServerFlags(app, flags.server);
  app.add_option("--capacity-blocks", flags.capacity_blocks, "test");
  app.add_option("--worker", flags.workers, "test");
  AddFlagSources(app, "dsa-test");
}

// Parses `command_line` (without the program name); the error message, or "" when it parsed.
std::string Parse(Flags& flags, const std::string& command_line) {
  CLI::App app{"test"};
  Add(app, flags);
  try {
    app.parse(command_line, /*program_name_included=*/false);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

// Each test runs as its own process beside others (ctest -j): the pid keeps their files apart.
std::string WriteFile(const std::string& name, const std::string& text) {
  std::string path =
      ::testing::TempDir() + "/server_flags_test_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ServerFlagsTest, DefaultsListenOnEveryInterfaceAtEachComponentsPorts) {
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kCoordinator).listen, "0.0.0.0:50051");
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kIndexer).listen, "0.0.0.0:50052");
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kAttention).listen, "0.0.0.0:50053");
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kCoordinator).metrics_listen, "0.0.0.0:9401");
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kIndexer).metrics_listen, "0.0.0.0:9402");
  EXPECT_EQ(DefaultServerFlags(ServerComponent::kAttention).metrics_listen, "0.0.0.0:9403");
  Flags flags;
  EXPECT_EQ(Parse(flags, ""), "");
  EXPECT_EQ(flags.server.listen, "0.0.0.0:50052");
  EXPECT_EQ(flags.server.log_level, "info");
}

TEST(ServerFlagsTest, AddressesAreCheckedWithPreciseMessages) {
  const CLI::Validator any_port = HostPortValidator(0, /*allow_empty=*/false);
  const CLI::Validator worker = HostPortValidator(1, /*allow_empty=*/false);
  const CLI::Validator optional = HostPortValidator(0, /*allow_empty=*/true);
  for (std::string good : {"0.0.0.0:50051", "127.0.0.1:0", "[::]:9401", "[::1]:1",
                           "dsa-indexer-0.dsa-indexer:50052", "localhost:65535"}) {
    EXPECT_EQ(any_port(good), "") << good;
  }
  std::string empty;
  EXPECT_EQ(optional(empty), "");
  EXPECT_NE(any_port(empty), "");
  std::string value = "127.0.0.1:70000";
  EXPECT_EQ(any_port(value), "port 70000 is out of range 0..65535 in 127.0.0.1:70000");
  value = "127.0.0.1:0";
  EXPECT_EQ(worker(value), "port 0 is out of range 1..65535 in 127.0.0.1:0");
  value = "127.0.0.1";
  EXPECT_EQ(any_port(value), "\"127.0.0.1\" is not host:port");
  value = "host:http";
  EXPECT_EQ(any_port(value), "bad port \"http\" in host:http");
  value = "host:+80";
  EXPECT_EQ(any_port(value), "bad port \"+80\" in host:+80");
  value = "::1:80";
  EXPECT_NE(any_port(value).find("in brackets"), std::string::npos);

  Flags flags;
  const std::string error = Parse(flags, "--listen 0.0.0.0:99999");
  EXPECT_NE(error.find("port 99999 is out of range"), std::string::npos) << error;
  EXPECT_EQ(flags.server.listen, "0.0.0.0:50052");  // unchanged
}

TEST(ServerFlagsTest, EveryFlagAlsoComesFromItsEnvironmentVariable) {
  setenv("DSA_CAPACITY_BLOCKS", "64", 1);
  setenv("DSA_WORKER", "a:1,b:2", 1);
  setenv("DSA_LISTEN", "127.0.0.1:7000", 1);
  Flags flags;
  EXPECT_EQ(Parse(flags, "--listen 127.0.0.1:8000"), "");
  EXPECT_EQ(flags.capacity_blocks, 64);
  EXPECT_EQ(flags.workers, (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(flags.server.listen, "127.0.0.1:8000");  // the command line wins
  setenv("DSA_METRICS_LISTEN", "nonsense", 1);
  Flags bad;
  EXPECT_NE(Parse(bad, "").find("nonsense"), std::string::npos);
  for (const char* name :
       {"DSA_CAPACITY_BLOCKS", "DSA_WORKER", "DSA_LISTEN", "DSA_METRICS_LISTEN"}) {
    unsetenv(name);
  }
}

TEST(ServerFlagsTest, AConfigFileSetsFlagsUnderTheCommandLineAndOverTheEnvironment) {
  const std::string path =
      WriteFile("flags.toml",
                "capacity-blocks = 128\nworker = [\"c:3\", \"d:4\"]\nlog-level = \"warn\"\n"
                "drain-delay-ms = 2500\n");
  setenv("DSA_CAPACITY_BLOCKS", "64", 1);
  setenv("DSA_DRAIN_DELAY_MS", "10", 1);
  Flags flags;
  EXPECT_EQ(Parse(flags, "--config " + path + " --drain-delay-ms 3000"), "");
  EXPECT_EQ(flags.capacity_blocks, 128);
  EXPECT_EQ(flags.workers, (std::vector<std::string>{"c:3", "d:4"}));
  EXPECT_EQ(flags.server.log_level, "warn");
  EXPECT_EQ(flags.server.drain_delay_ms, 3000);
  unsetenv("DSA_CAPACITY_BLOCKS");
  unsetenv("DSA_DRAIN_DELAY_MS");
  SetLogLevel("info");

  setenv("DSA_CONFIG", path.c_str(), 1);
  Flags from_env;
  EXPECT_EQ(Parse(from_env, ""), "");
  EXPECT_EQ(from_env.capacity_blocks, 128);
  setenv("DSA_CONFIG", "/nonexistent/flags.toml", 1);
  Flags missing;
  EXPECT_NE(Parse(missing, "").find("/nonexistent/flags.toml"), std::string::npos);
  unsetenv("DSA_CONFIG");
  Flags missing_flag;
  EXPECT_NE(Parse(missing_flag, "--config /nonexistent/other.toml").find("other.toml"),
            std::string::npos);

  const std::string bad = WriteFile("bad.toml", "no-such-flag = 1\n");
  Flags unknown;
  EXPECT_NE(Parse(unknown, "--config " + bad).find("no-such-flag"), std::string::npos);
  SetLogLevel("info");
}

// The file is TOML read by a TOML parser: '_' and '-' alike, and every refusal names the file,
// line and column; a misspelt name is answered with the flag meant.
TEST(ServerFlagsTest, TheConfigFileIsTomlWithPositionedErrorsAndSuggestions) {
  const std::string underscores =
      WriteFile("underscores.toml",
                "# a comment\ncapacity_blocks = 100\ndrain_delay_ms = 250\nworker = [\"a:1\"]\n");
  Flags flags;
  EXPECT_EQ(Parse(flags, "--config " + underscores), "");
  EXPECT_EQ(flags.capacity_blocks, 100);
  EXPECT_EQ(flags.server.drain_delay_ms, 250);
  EXPECT_EQ(flags.workers, std::vector<std::string>{"a:1"});

  const std::vector<std::pair<std::string, std::string>> refused = {
      {"capacity-blocks = [1\n", "bad.toml:1:22: not TOML: Error while parsing array"},
      {"\n\ncapacity_blok = 1\n",
       "bad.toml:3:1: 'capacity_blok' is not a flag of this server; "
       "did you mean capacity-blocks?"},
      {"[server]\nlisten = \"a:1\"\n", "bad.toml:1:2: [server] is a table"},
      {"worker = [[\"a\"]]\n", "worker: a list holds strings, numbers or booleans only"},
      {"capacity-blocks = 1979-05-27\n", "a date or time is not a flag value"},
      {"zzzzzzzzzz = 1\n", "'zzzzzzzzzz' is not a flag of this server (--help lists them)"},
      {"capacity-blocks = 1\ncapacity_blocks = 2\n",
       "bad.toml:2:1: 'capacity_blocks' sets --capacity-blocks, which an earlier line sets too"},
  };
  for (const auto& [text, message] : refused) {
    const std::string path = WriteFile("bad.toml", text);
    Flags bad;
    const std::string error = Parse(bad, "--config " + path);
    EXPECT_NE(error.find(message), std::string::npos) << text << " -> " << error;
  }
  // A value of the right TOML type is still checked by the flag's own validator.
  const std::string range = WriteFile("range.toml", "drain-delay-ms = -5\n");
  Flags negative;
  EXPECT_NE(Parse(negative, "--config " + range).find("drain-delay-ms"), std::string::npos);
}

TEST(ServerFlagsTest, AMisspeltFlagIsAnsweredWithTheFlagMeant) {
  CLI::App app{"test"};
  Flags flags;
  Add(app, flags);
  EXPECT_EQ(SuggestFlags(app, "--capacity-blok"), std::vector<std::string>{"capacity-blocks"});
  EXPECT_EQ(SuggestFlags(app, "metrics_listen"), std::vector<std::string>{"metrics-listen"});
  EXPECT_TRUE(SuggestFlags(app, "--qqqqqqqqqqqq").empty());
  EXPECT_TRUE(SuggestFlags(app, "--helq").empty());  // --help is never suggested

  std::vector<std::string> args = {"test", "--capacity-blok", "3"};
  std::vector<char*> argv;
  argv.reserve(args.size());
  for (std::string& arg : args) argv.push_back(arg.data());
  CLI::App parsed{"test"};
  Flags more;
  Add(parsed, more);
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  const int code = ParseServerFlags(parsed, static_cast<int>(argv.size()), argv.data());
  (void)::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_GT(code, 0);
  EXPECT_NE(err.find("--capacity-blok: did you mean --capacity-blocks?"), std::string::npos) << err;
}

TEST(ServerFlagsTest, VersionPrintsTheBinaryAndTheBuildsVersion) {
  CLI::App app{"test"};
  Flags flags;
  Add(app, flags);
  try {
    app.parse("--version", /*program_name_included=*/false);
    FAIL() << "--version did not stop the parse";
  } catch (const CLI::CallForVersion& e) {
    EXPECT_EQ(app.exit(e), 0);
  }
  // The release (VERSION, the chart's appVersion) leads, the tree's git state follows.
  const std::string release = ReleaseVersion();
  EXPECT_EQ(std::string(BuildVersion()).rfind(release, 0), 0u) << BuildVersion();
  EXPECT_EQ(std::count(release.begin(), release.end(), '.'), 2) << release;
}

TEST(ServerFlagsTest, LogLevelsAreTheFourNames) {
  for (const char* level : {"debug", "info", "warn", "error"}) EXPECT_TRUE(SetLogLevel(level));
  EXPECT_FALSE(SetLogLevel("loud"));
  EXPECT_FALSE(SetLogLevel("WARN"));
  EXPECT_TRUE(SetLogLevel("info"));
  Flags flags;
  EXPECT_NE(Parse(flags, "--log-level loud").find("loud"), std::string::npos);
}

TEST(ProcessMetricsTest, CollectsTheStandardProcessFamiliesWithPlausibleValues) {
  const std::vector<prometheus::MetricFamily> families = ProcessMetrics().Collect();
  auto value = [&](const std::string& name) -> double {
    for (const prometheus::MetricFamily& family : families) {
      if (family.name != name) continue;
      EXPECT_EQ(family.metric.size(), 1u) << name;
      return family.type == prometheus::MetricType::Counter ? family.metric[0].counter.value
                                                            : family.metric[0].gauge.value;
    }
    ADD_FAILURE() << name << " missing";
    return -1;
  };
  EXPECT_GE(value("process_cpu_seconds_total"), 0);
  EXPECT_GT(value("process_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(value("process_virtual_memory_bytes"), value("process_resident_memory_bytes"));
  const double start = value("process_start_time_seconds");
  const double now = static_cast<double>(time(nullptr));
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 24 * 3600);  // a test process started within the day
  EXPECT_GE(value("process_open_fds"), 3);
  EXPECT_GE(value("process_max_fds"), value("process_open_fds"));
}

}  // namespace
}  // namespace dsa
