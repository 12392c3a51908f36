// TLS, mutual TLS, bearer tokens and sequence ownership against the real binaries on loopback
// (docs/reliability.md, "Security"), with certificates made by openssl for the test (tests/testing/
// test_pki.h):
// - a TLS port refuses plaintext, a server certificate of another CA, and (mutual TLS) clients
//   without a certificate or with one of another CA; the plaintext --health-listen port answers;
// - sequences belong to the caller that created them, on the indexer and the attention worker;
//   the indexer's --operator-identities may release any;
// - the attention worker dials only its --indexer-workers, over mutual TLS;
// - the coordinator's bearer tokens: missing or wrong is UNAUTHENTICATED, another client's Abort
//   is NOT_FOUND (request ids are per caller); a Generate runs over TLS on every hop; tokens
//   without TLS do not start.
#include "server/security.h"

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"
#include "tests/testing/test_pki.h"

namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;
using dsa::testing::Process;
using dsa::testing::TestIdentity;

constexpr int kHeads = 8;
constexpr int kHeadDim = 32;

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new dsa::testing::TestPki();
    ASSERT_TRUE(pki_->ok()) << "openssl could not make the test CAs (is openssl installed?)";
    for (const char* name : {"indexer", "attention", "coordinator", "intruder"}) {
      identities_[name] = pki_->Issue(name);
      ASSERT_FALSE(identities_[name].cert.empty()) << name;
    }
    outsider_ = pki_->Issue("outsider", /*by_wrong_ca=*/true);
    ASSERT_FALSE(outsider_.cert.empty());
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void TearDown() override {
    for (const Process& p : processes_) {
      if (p.pid > 0) {
        kill(p.pid, SIGKILL);
        dsa::testing::WaitExit(p.pid, std::chrono::seconds(10));
      }
    }
  }

  // The server flags of mutual TLS with `name`'s certificate.
  static std::vector<std::string> MutualTls(const std::string& name) {
    const TestIdentity& id = identities_[name];
    return {"--tls-cert",      id.cert,    "--tls-key", id.key,
            "--tls-client-ca", pki_->ca(), "--tls-ca",  pki_->ca()};
  }

  Process Start(const std::string& binary, std::vector<std::string> flags) {
    processes_.push_back(dsa::testing::StartServer(binary, flags));
    return processes_.back();
  }
  Process StartIndexer(std::vector<std::string> more = {}) {
    std::vector<std::string> flags = MutualTls("indexer");
    flags.insert(flags.end(), {"--capacity-blocks", "512", "--num-heads", std::to_string(kHeads),
                               "--head-dim", std::to_string(kHeadDim)});
    flags.insert(flags.end(), more.begin(), more.end());
    return Start(DSA_INDEXER_BINARY, flags);
  }

  // A channel trusting `ca` (empty: plaintext), showing `identity`'s certificate if it has one.
  static std::shared_ptr<grpc::Channel> Dial(const std::string& address, const std::string& ca,
                                             const TestIdentity& identity = {},
                                             const std::string& token = "") {
    dsa::TlsFlags tls;
    tls.ca_file = ca;
    tls.cert_file = identity.cert;
    tls.key_file = identity.key;
    absl::StatusOr<dsa::ClientSecurity> security = dsa::ClientSecurityFrom(tls, token);
    EXPECT_TRUE(security.ok()) << security.status();
    return dsa::NewChannel(address, security.ok() ? *security : dsa::ClientSecurity());
  }
  static std::shared_ptr<grpc::Channel> DialAs(const std::string& address,
                                               const std::string& name) {
    return Dial(address, pki_->ca(), identities_[name]);
  }

  static grpc::Status IndexerGetLoad(const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    iv1::GetLoadResponse load;
    return iv1::IndexerService::NewStub(channel)->GetLoad(&context, iv1::GetLoadRequest(), &load);
  }
  static grpc::Status CreateSequence(const std::shared_ptr<grpc::Channel>& channel, uint64_t id) {
    grpc::ClientContext context;
    iv1::CreateSequenceRequest request;
    request.set_sequence_id(id);
    request.set_num_layers(2);
    request.set_top_k(64);
    iv1::CreateSequenceResponse response;
    return iv1::IndexerService::NewStub(channel)->CreateSequence(&context, request, &response);
  }
  static grpc::Status IndexerRelease(const std::shared_ptr<grpc::Channel>& channel, uint64_t id) {
    grpc::ClientContext context;
    iv1::ReleaseRequest request;
    request.set_sequence_id(id);
    iv1::ReleaseResponse response;
    return iv1::IndexerService::NewStub(channel)->Release(&context, request, &response);
  }

  static dsa::testing::TestPki* pki_;
  static std::map<std::string, TestIdentity> identities_;
  static TestIdentity outsider_;
  std::vector<Process> processes_;
};

dsa::testing::TestPki* SecurityTest::pki_ = nullptr;
std::map<std::string, TestIdentity> SecurityTest::identities_;
TestIdentity SecurityTest::outsider_;

TEST_F(SecurityTest, MutualTlsRefusesPlaintextOtherCasAndMissingCertificates) {
  const Process indexer = StartIndexer({"--health-listen", "127.0.0.1:0"});
  ASSERT_FALSE(indexer.address.empty());
  ASSERT_FALSE(indexer.health_address.empty());

  // Plaintext to a TLS port: the handshake fails, the call never reaches a handler.
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, "")).error_code(), grpc::StatusCode::UNAVAILABLE);
  // Trusting another CA: the server's certificate is refused.
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, pki_->wrong_ca(), identities_["attention"]))
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // Mutual TLS: no client certificate, or one of another CA.
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, pki_->ca())).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, pki_->ca(), outsider_)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // The right CA and a certificate it signed.
  EXPECT_TRUE(IndexerGetLoad(DialAs(indexer.address, "attention")).ok());
  // `dsa health` in plaintext against the TLS port says why the connection fails, not only that
  // its deadline passed.
  {
    const std::string command = std::string(DSA_BINARY) + " health --target " + indexer.address +
                                " --service liveness --timeout-ms 1000 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buffer[512];
    while (fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
    EXPECT_NE(pclose(pipe), 0);
    EXPECT_NE(output.find("the connection kept failing"), std::string::npos) << output;
    EXPECT_NE(output.find("pass --tls-ca"), std::string::npos) << output;
  }

  // The plaintext health port answers the probes (kubelet speaks no TLS) and nothing else.
  const auto health = Dial(indexer.health_address, "");
  EXPECT_EQ(dsa::testing::HealthStatus(health, "readiness"), 1);
  EXPECT_EQ(dsa::testing::HealthStatus(health, "liveness"), 1);
  EXPECT_EQ(IndexerGetLoad(health).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // Reflection lists only health (and itself) there: no dsa service is reachable in plaintext.
  const std::string listed = dsa::testing::ReflectionListServices(health);
  EXPECT_NE(listed.find("grpc.health.v1.Health"), std::string::npos);
  EXPECT_EQ(listed.find("dsa.indexer.v1"), std::string::npos);
}

TEST_F(SecurityTest, IndexerSequencesBelongToTheirCreatorAndOperators) {
  const Process indexer = StartIndexer({"--operator-identities", "coordinator"});
  ASSERT_FALSE(indexer.address.empty());
  const auto attention = DialAs(indexer.address, "attention");
  const auto intruder = DialAs(indexer.address, "intruder");
  const auto coordinator = DialAs(indexer.address, "coordinator");

  ASSERT_TRUE(CreateSequence(attention, 7).ok());
  const grpc::Status taken = CreateSequence(intruder, 7);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(taken.error_message(), "sequence 7 belongs to another caller");
  EXPECT_EQ(IndexerRelease(intruder, 7).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Another caller cannot clone the sequence's index keys as its prefix; its owner can.
  const auto clone = [](const std::shared_ptr<grpc::Channel>& channel, uint64_t id) {
    grpc::ClientContext context;
    iv1::CreateSequenceRequest request;
    request.set_sequence_id(id);
    request.set_num_layers(2);
    request.set_top_k(64);
    request.set_prefix_source_id(7);
    iv1::CreateSequenceResponse response;
    return iv1::IndexerService::NewStub(channel)->CreateSequence(&context, request, &response);
  };
  const grpc::Status cloned = clone(intruder, 8);
  EXPECT_EQ(cloned.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(cloned.error_message(), "prefix_source_id: sequence 7 belongs to another caller");
  EXPECT_TRUE(clone(attention, 8).ok());
  EXPECT_TRUE(IndexerRelease(attention, 8).ok());
  {
    grpc::ClientContext context;
    iv1::CommitRequest request;
    request.set_sequence_id(7);
    iv1::CommitResponse response;
    EXPECT_EQ(
        iv1::IndexerService::NewStub(intruder)->Commit(&context, request, &response).error_code(),
        grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    iv1::SelectRequest request;
    request.add_groups()->set_sequence_id(7);
    iv1::SelectResponse response;
    EXPECT_EQ(
        iv1::IndexerService::NewStub(intruder)->Select(&context, request, &response).error_code(),
        grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    iv1::AppendIndexKeysResponse response;
    auto writer = iv1::IndexerService::NewStub(intruder)->AppendIndexKeys(&context, &response);
    iv1::AppendIndexKeysRequest chunk;
    chunk.set_sequence_id(7);
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(status.error_message(), "chunk 0: sequence 7 belongs to another caller");
  }
  // The creator still has its sequence; an operator (the coordinator) may release it; then the
  // id is free for anyone.
  {
    grpc::ClientContext context;
    iv1::BeginTurnRequest request;
    request.set_sequence_id(7);
    iv1::BeginTurnResponse response;
    EXPECT_TRUE(
        iv1::IndexerService::NewStub(attention)->BeginTurn(&context, request, &response).ok());
  }
  EXPECT_TRUE(IndexerRelease(coordinator, 7).ok());
  EXPECT_TRUE(CreateSequence(intruder, 7).ok());
  EXPECT_TRUE(IndexerRelease(intruder, 7).ok());
}

TEST_F(SecurityTest, AttentionDialsOnlyItsIndexersOverMutualTlsAndOwnsSequencesByCaller) {
  const Process indexer = StartIndexer();
  ASSERT_FALSE(indexer.address.empty());
  std::vector<std::string> flags = MutualTls("attention");
  flags.insert(flags.end(),
               {"--num-heads", std::to_string(kHeads), "--head-dim", std::to_string(kHeadDim),
                "--layer-pattern", "FSFS", "--indexer-workers", indexer.address});
  const Process attention = Start(DSA_ATTENTION_BINARY, flags);
  ASSERT_FALSE(attention.address.empty());
  auto prefill = [&](const std::string& caller, uint64_t id, const std::string& indexer_worker) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    av1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_context_length(300);
    request.set_indexer_worker(indexer_worker);
    request.mutable_settings()->set_top_k(64);
    av1::PrefillResponse response;
    return av1::AttentionService::NewStub(DialAs(attention.address, caller))
        ->Prefill(&context, request, &response);
  };
  auto release = [&](const std::string& caller, uint64_t id) {
    grpc::ClientContext context;
    av1::ReleaseRequest request;
    request.set_sequence_id(id);
    av1::ReleaseResponse response;
    return av1::AttentionService::NewStub(DialAs(attention.address, caller))
        ->Release(&context, request, &response);
  };

  // The attention worker reaches its indexer over mutual TLS (its own certificate).
  const grpc::Status placed = prefill("coordinator", 1, indexer.address);
  ASSERT_TRUE(placed.ok()) << placed.error_message();
  // An address it was not configured with is never dialed.
  const grpc::Status elsewhere = prefill("coordinator", 2, "127.0.0.1:1");
  EXPECT_EQ(elsewhere.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << elsewhere.error_message();
  EXPECT_NE(elsewhere.error_message().find("127.0.0.1:1"), std::string::npos);
  // Another caller cannot release, step or continue the coordinator's sequence.
  EXPECT_EQ(release("intruder", 1).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  {
    grpc::ClientContext context;
    av1::DecodeStepRequest request;
    av1::SequenceStep* step = request.add_sequences();
    step->set_sequence_id(1);
    step->set_rows(1);
    av1::DecodeStepResponse response;
    EXPECT_EQ(av1::AttentionService::NewStub(DialAs(attention.address, "intruder"))
                  ->DecodeStep(&context, request, &response)
                  .error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(prefill("intruder", 1, indexer.address).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(release("coordinator", 1).ok());
}

// Co-located (--transport inprocess): the engine creates the indexer sequences in process, past
// the indexer service it also serves at its port. The Prefill's caller owns them there too, so
// another caller cannot release or use them through that port, while the coordinator can release
// a prefix donor's index keys it kept.
TEST_F(SecurityTest, ColocatedIndexerSequencesBelongToThePrefillsCaller) {
  std::vector<std::string> flags = MutualTls("attention");
  flags.insert(flags.end(), {"--num-heads", std::to_string(kHeads), "--head-dim",
                             std::to_string(kHeadDim), "--layer-pattern", "FSFS", "--transport",
                             "inprocess", "--indexer-capacity-blocks", "512"});
  const Process attention = Start(DSA_ATTENTION_BINARY, flags);
  ASSERT_FALSE(attention.address.empty());
  auto prefill = [&](uint64_t id) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    av1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_context_length(300);
    request.set_indexer_worker(attention.address);
    request.mutable_settings()->set_top_k(64);
    av1::PrefillResponse response;
    return av1::AttentionService::NewStub(DialAs(attention.address, "coordinator"))
        ->Prefill(&context, request, &response);
  };
  auto release = [&](uint64_t id, bool keep_indexer_sequence) {
    grpc::ClientContext context;
    av1::ReleaseRequest request;
    request.set_sequence_id(id);
    request.set_keep_indexer_sequence(keep_indexer_sequence);
    av1::ReleaseResponse response;
    return av1::AttentionService::NewStub(DialAs(attention.address, "coordinator"))
        ->Release(&context, request, &response);
  };
  const grpc::Status placed = prefill(1);
  ASSERT_TRUE(placed.ok()) << placed.error_message();
  const grpc::Status taken = IndexerRelease(DialAs(attention.address, "intruder"), 1);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::PERMISSION_DENIED) << taken.error_message();
  EXPECT_EQ(taken.error_message(), "sequence 1 belongs to another caller");
  // Kept as a prefix donor: still the coordinator's on the indexer, which it releases there.
  ASSERT_TRUE(release(1, /*keep_indexer_sequence=*/true).ok());
  EXPECT_EQ(IndexerRelease(DialAs(attention.address, "intruder"), 1).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  const grpc::Status donor_released = IndexerRelease(DialAs(attention.address, "coordinator"), 1);
  EXPECT_TRUE(donor_released.ok()) << donor_released.error_message();
  // A donor of another caller cannot be cloned through a Prefill here either.
  ASSERT_TRUE(prefill(3).ok());
  ASSERT_TRUE(release(3, /*keep_indexer_sequence=*/true).ok());
  {
    grpc::ClientContext context;
    av1::PrefillRequest request;
    request.set_sequence_id(4);
    request.set_context_length(600);
    request.set_indexer_worker(attention.address);
    request.set_prefix_source_id(3);
    request.set_prefix_slots(512);
    request.mutable_settings()->set_top_k(64);
    av1::PrefillResponse response;
    const grpc::Status cloned =
        av1::AttentionService::NewStub(DialAs(attention.address, "intruder"))
            ->Prefill(&context, request, &response);
    EXPECT_EQ(cloned.error_code(), grpc::StatusCode::PERMISSION_DENIED) << cloned.error_message();
    EXPECT_EQ(cloned.error_message(), "prefix_source_id: sequence 3 belongs to another caller");
  }
  // Released whole: gone from both, and its id is free again.
  ASSERT_TRUE(prefill(2).ok());
  ASSERT_TRUE(release(2, /*keep_indexer_sequence=*/false).ok());
  EXPECT_EQ(IndexerRelease(DialAs(attention.address, "intruder"), 2).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(SecurityTest, CoordinatorTokensAuthenticateRoutersAndGuardTheirRequests) {
  const Process indexer = StartIndexer({"--operator-identities", "coordinator"});
  ASSERT_FALSE(indexer.address.empty());
  std::vector<std::string> attention_flags = MutualTls("attention");
  attention_flags.insert(
      attention_flags.end(),
      {"--num-heads", std::to_string(kHeads), "--head-dim", std::to_string(kHeadDim),
       "--layer-pattern", "FSFS", "--indexer-workers", indexer.address});
  const Process attention = Start(DSA_ATTENTION_BINARY, attention_flags);
  ASSERT_FALSE(attention.address.empty());
  const std::string tokens =
      pki_->Write("tokens", "# router tokens\nrouter-a token-of-a\n\nrouter-b token-of-b\n");
  const TestIdentity& id = identities_["coordinator"];
  const Process coordinator =
      Start(DSA_COORDINATOR_BINARY,
            {"--tls-cert", id.cert, "--tls-key", id.key, "--tls-ca", pki_->ca(),
             "--auth-tokens-file", tokens, "--indexer", indexer.address, "--attention",
             attention.address, "--top-k", "64", "--worker-check-interval-ms", "200"});
  ASSERT_FALSE(coordinator.address.empty());
  auto stub = [&](const std::string& token) {
    return cv1::CoordinatorService::NewStub(Dial(coordinator.address, pki_->ca(), {}, token));
  };
  auto get_load = [&](const std::string& token) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    cv1::GetLoadResponse load;
    return stub(token)->GetLoad(&context, cv1::GetLoadRequest(), &load);
  };
  const grpc::Status missing = get_load("");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(missing.error_message().find("missing bearer token"), std::string::npos);
  EXPECT_EQ(get_load("token-of-c").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(get_load("token-of-a").ok());

  // Wait until the coordinator is ready (both workers checked over mutual TLS).
  {
    const auto channel = Dial(coordinator.address, pki_->ca(), {}, "token-of-a");
    (void)dsa::testing::WatchHealthUntil(channel, "readiness", 1, std::chrono::seconds(20));
    ASSERT_EQ(dsa::testing::HealthStatus(channel, "readiness"), 1);
  }
  auto generate_request = [](const std::string& id, int64_t max_new) {
    cv1::GenerateRequest request;
    request.set_request_id(id);
    request.set_context_length(300);
    request.set_max_new_tokens(max_new);
    return request;
  };
  // A request decoded to its end, over TLS on every hop.
  {
    auto a = stub("token-of-a");
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = a->Generate(&context, generate_request("short", 8));
    cv1::GenerateEvent event;
    int64_t tokens_seen = 0;
    while (reader->Read(&event)) tokens_seen += event.has_tokens() ? event.tokens().count() : 0;
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(tokens_seen, 8);
  }
  // router-a's long request: router-b cannot abort it, router-a can.
  auto a = stub("token-of-a");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = a->Generate(&context, generate_request("long", 15000));
  cv1::GenerateEvent event;
  ASSERT_TRUE(reader->Read(&event)) << reader->Finish().error_message();  // admitted
  auto abort = [&](const std::string& token) {
    grpc::ClientContext abort_context;
    cv1::AbortRequest request;
    request.set_request_id("long");
    cv1::AbortResponse response;
    return stub(token)->Abort(&abort_context, request, &response);
  };
  const grpc::Status foreign = abort("token-of-b");
  // Request ids are scoped per caller: b is told what an id it never used would tell it.
  EXPECT_EQ(foreign.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(foreign.error_message(), "no request 'long' of this caller in flight");
  EXPECT_TRUE(abort("token-of-a").ok());
  while (reader->Read(&event)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);

  // A router that carries several tokens over one connection (per-call credentials): each call is
  // its own token's client. gRPC's auth context belongs to the connection, and the coordinator
  // once named every call on it by the first token seen there, so that here router-b could abort
  // router-a's request.
  const auto shared = Dial(coordinator.address, pki_->ca());
  auto shared_stub = cv1::CoordinatorService::NewStub(shared);
  auto as = [](grpc::ClientContext& call_context, const std::string& token) {
    call_context.set_credentials(grpc::AccessTokenCredentials(token));
  };
  {
    grpc::ClientContext first;
    as(first, "token-of-a");
    cv1::GetLoadResponse load;
    ASSERT_TRUE(shared_stub->GetLoad(&first, cv1::GetLoadRequest(), &load).ok());
  }
  grpc::ClientContext b_context;
  as(b_context, "token-of-b");
  b_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto b_reader = shared_stub->Generate(&b_context, generate_request("b-long", 15000));
  ASSERT_TRUE(b_reader->Read(&event)) << b_reader->Finish().error_message();  // admitted
  auto abort_on_shared = [&](const std::string& token) {
    grpc::ClientContext abort_context;
    as(abort_context, token);
    cv1::AbortRequest request;
    request.set_request_id("b-long");
    cv1::AbortResponse response;
    return shared_stub->Abort(&abort_context, request, &response);
  };
  EXPECT_EQ(abort_on_shared("token-of-a").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(abort_on_shared("token-of-b").ok());
  while (b_reader->Read(&event)) {
  }
  EXPECT_EQ(b_reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

// Runs `command` (stderr to `log`), its exit code.
int ExitCodeOf(const std::string& command, const std::string& log) {
  const int status = std::system((command + " >/dev/null 2>" + log).c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_F(SecurityTest, TokensWithoutTlsAndHalfACertificatePairDoNotStart) {
  const std::string tokens = pki_->Write("tokens-plain", "router-a token-of-a\n");
  const std::string log = pki_->dir() + "/stderr.log";
  EXPECT_EQ(ExitCodeOf(absl::StrCat("timeout 20 ", DSA_COORDINATOR_BINARY,
                                    " --listen 127.0.0.1:0 --metrics-listen none",
                                    " --indexer 127.0.0.1:1 --attention 127.0.0.1:2",
                                    " --auth-tokens-file ", tokens),
                       log),
            1);
  EXPECT_NE(ReadAll(log).find("bearer tokens need TLS"), std::string::npos) << ReadAll(log);
  EXPECT_EQ(ExitCodeOf(absl::StrCat("timeout 20 ", DSA_INDEXER_BINARY,
                                    " --listen 127.0.0.1:0 --metrics-listen none --tls-cert ",
                                    identities_["indexer"].cert),
                       log),
            1);
  EXPECT_NE(ReadAll(log).find("--tls-cert and --tls-key go together"), std::string::npos)
      << ReadAll(log);
}

// Where no folder can be had for the checked copies (a read-only root file system without a
// writable /dev/shm or /tmp), the server still serves TLS: the files, checked once at start, are
// watched directly, with a warning. The process runs in a mount namespace of its own whose /dev/shm
// and /tmp are read-only (unshare; skipped where this machine does not allow it).
TEST_F(SecurityTest, WithNoWritableFolderTheTlsFilesAreWatchedUncheckedAndServed) {
  const std::string log = pki_->dir() + "/readonly-stderr.log";
  // stderr is opened before the mounts, so it stays writable after them.
  const std::string script =
      absl::StrCat("#!/bin/sh\nexec 2>\"", log, "\"\n", "for d in /dev/shm /tmp; do\n",
                   "  mount --bind \"$d\" \"$d\" && mount -o remount,bind,ro \"$d\" || exit 97\n",
                   "done\nunset TMPDIR\nexec \"$@\"\n");
  const std::string wrapper = pki_->Write("readonly-tmp.sh", script);
  if (std::system(("chmod +x " + wrapper).c_str()) != 0 ||
      std::system(("unshare -m --propagation private " + wrapper + " true 2>/dev/null").c_str()) !=
          0) {
    GTEST_SKIP() << "unshare -m with read-only bind mounts is not allowed here";
  }
  std::vector<std::string> flags = {"-m", "--propagation", "private", wrapper, DSA_INDEXER_BINARY};
  for (const std::string& f : MutualTls("indexer")) flags.push_back(f);
  // Named here, after the binary (StartServer would put them before it, for unshare).
  flags.insert(flags.end(), {"--capacity-blocks", "64", "--num-heads", std::to_string(kHeads),
                             "--head-dim", std::to_string(kHeadDim), "--listen", "127.0.0.1:0",
                             "--metrics-listen", "127.0.0.1:0"});
  const Process indexer = Start("/usr/bin/unshare", flags);
  ASSERT_FALSE(indexer.address.empty()) << ReadAll(log);
  EXPECT_TRUE(IndexerGetLoad(DialAs(indexer.address, "attention")).ok()) << ReadAll(log);
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, "")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(IndexerGetLoad(Dial(indexer.address, pki_->ca(), outsider_)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  const std::string logged = ReadAll(log);
  EXPECT_NE(logged.find("TLS files watched without checks at reload"), std::string::npos) << logged;
  EXPECT_NE(logged.find("/dev/shm: Read-only file system"), std::string::npos) << logged;
}

}  // namespace
