// Unit tests of server/security.h (bearer tokens, owners, credential errors, certificate reload
// and name checks over an in-process server) and of the attention worker's indexer allow-list
// (OnlyIndexerWorkers). The handshakes between the binaries are tested in
// tests/integration/security_test.cc.
#include "server/security.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/loopback_server.h"
#include "tests/testing/test_pki.h"
#include "transport/grpc_indexer_client.h"

namespace dsa {
namespace {

using ::testing::HasSubstr;

// The end iterator (its constructor is protected).
struct NoProperties : grpc::AuthPropertyIterator {
  NoProperties() = default;
};

// An AuthContext holding properties in a map (gRPC's own needs a core security context).
class FakeAuthContext final : public grpc::AuthContext {
 public:
  bool IsPeerAuthenticated() const override { return false; }
  std::vector<grpc::string_ref> GetPeerIdentity() const override { return {}; }
  std::string GetPeerIdentityPropertyName() const override { return ""; }
  std::vector<grpc::string_ref> FindPropertyValues(const std::string& name) const override {
    std::vector<grpc::string_ref> values;
    for (auto [it, end] = properties_.equal_range(name); it != end; ++it) {
      values.emplace_back(it->second);
    }
    return values;
  }
  grpc::AuthPropertyIterator begin() const override { return NoProperties(); }
  grpc::AuthPropertyIterator end() const override { return NoProperties(); }
  void AddProperty(const std::string& key, const grpc::string_ref& value) override {
    properties_.emplace(key, std::string(value.data(), value.size()));
  }
  bool SetPeerIdentityPropertyName(const std::string& /*name*/) override { return false; }
  bool empty() const { return properties_.empty(); }

 private:
  std::multimap<std::string, std::string> properties_;
};

grpc::Status Authenticate(BearerTokenAuthenticator& tokens, const char* header,
                          FakeAuthContext* context) {
  grpc::AuthMetadataProcessor::InputMetadata metadata;
  if (header != nullptr) metadata.emplace("authorization", header);
  grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
  return tokens.Process(metadata, context, &consumed, &response);
}

// A plaintext caller's tenant is its peer's host: the port (a new one per connection) is left out,
// so a client's reconnections stay one tenant.
TEST(PeerHostTest, DropsThePortOfIpPeersAndKeepsOtherPeersWhole) {
  EXPECT_EQ(PeerHost("ipv4:1.2.3.4:5"), "1.2.3.4");
  EXPECT_EQ(PeerHost("ipv4:10.0.0.7:54321"), "10.0.0.7");
  EXPECT_EQ(PeerHost("ipv6:[::1]:5"), "[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5B::1%5D:5"), "[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5Bfe80::1%25eth0%5D:443"), "[fe80::1%eth0]");
  EXPECT_EQ(PeerHost("unix:/tmp/dsa.sock"), "unix:/tmp/dsa.sock");
  EXPECT_EQ(PeerHost("unix-abstract:dsa"), "unix-abstract:dsa");
  EXPECT_EQ(PeerHost("ipv4:1.2.3.4"), "1.2.3.4");
  EXPECT_EQ(PeerHost(""), "");
}

TEST(BearerTokenAuthenticatorTest, ParsesClientTokenLinesAndRefusesBadFiles) {
  auto tokens = BearerTokenAuthenticator::Parse("# routers\n\nrouter-a aaaa\n  router-b\tbbbb  \n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ((*tokens)->size(), 2u);

  const std::vector<std::pair<const char*, const char*>> bad = {
      {"router-a\n", "line 1: expected \"CLIENT TOKEN\" (two fields), found 1"},
      {"a x\nb y z\n", "line 2: expected \"CLIENT TOKEN\" (two fields), found 3"},
      {"a same\nb same\n", "line 2: the token of b is also the token of a"},
      {"a x\na y\n", "line 2: client a is listed twice"},
      {"# only comments\n", "no \"CLIENT TOKEN\" line"},
  };
  for (const auto& [text, message] : bad) {
    auto parsed = BearerTokenAuthenticator::Parse(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(parsed.status().message(), message);
  }
  auto missing = BearerTokenAuthenticator::Load("/nonexistent/tokens");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/tokens"));
}

// Process refuses what ClientOf refuses and leaves the auth context and the metadata alone: gRPC's
// auth context is the connection's, so a property added there would name later calls of other
// tokens on the same connection by this one's client (the integration test
// CoordinatorTokensAuthenticateRoutersAndGuardTheirRequests sends two tokens over one connection).
TEST(BearerTokenAuthenticatorTest, AcceptsOnlyAKnownBearerTokenAndNamesItsClient) {
  auto tokens = BearerTokenAuthenticator::Parse("router-a aaaa\nrouter-b bbbb\n");
  ASSERT_TRUE(tokens.ok());
  for (const char* header : {static_cast<const char*>(nullptr), "Basic aaaa", "Bearer aaa",
                             "Bearer aaaaa", "Bearer ", "Bearer  aaaa"}) {
    FakeAuthContext context;
    const grpc::Status status = Authenticate(**tokens, header, &context);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << (header != nullptr ? header : "(none)");
    if (header != nullptr) {
      EXPECT_EQ((*tokens)->ClientOf(header).status().code(), absl::StatusCode::kUnauthenticated)
          << header;
    }
  }
  FakeAuthContext lower;
  EXPECT_TRUE(Authenticate(**tokens, "bearer aaaa", &lower).ok());  // the scheme's case is free
  FakeAuthContext context;
  grpc::AuthMetadataProcessor::InputMetadata metadata;
  metadata.emplace("authorization", "Bearer bbbb");
  grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
  EXPECT_TRUE((*tokens)->Process(metadata, &context, &consumed, &response).ok());
  EXPECT_TRUE(consumed.empty());  // the handler reads the header again (ClientOf)
  EXPECT_TRUE(context.empty());
  EXPECT_EQ((*tokens)->ClientOf("Bearer bbbb").value_or(""), "router-b");
  EXPECT_EQ((*tokens)->ClientOf("bearer aaaa").value_or(""), "router-a");
  EXPECT_EQ((*tokens)->ClientOf("Bearer cccc").status().message(), "unknown bearer token");
  EXPECT_EQ((*tokens)->ClientOf("Basic bbbb").status().message(),
            "the authorization header is not \"Bearer TOKEN\"");
}

TEST(OwnerTableTest, OnlyTheOwnerOrAnOperatorMayUseAnId) {
  OwnerTable owners({"coordinator"});
  absl::StatusOr<OwnerTable::Claim> created = owners.Acquire("7", "attention-0", "sequence");
  ASSERT_TRUE(created.ok());
  EXPECT_TRUE(created->is_new());
  created->Keep();
  EXPECT_FALSE(owners.Acquire("7", "attention-0", "sequence").value().is_new());
  const absl::StatusOr<OwnerTable::Claim> taken = owners.Acquire("7", "attention-1", "sequence");
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(taken.status().message(), "sequence 7 belongs to another caller");
  EXPECT_TRUE(owners.Check("7", "attention-0", "sequence").ok());
  EXPECT_TRUE(owners.Check("7", "coordinator", "sequence").ok());
  EXPECT_FALSE(owners.Acquire("7", "coordinator", "sequence").value().is_new());
  EXPECT_EQ(owners.Check("7", "", "sequence").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(owners.Check("8", "anyone", "sequence").ok());  // unknown: the engine answers
  EXPECT_FALSE(owners.Forget("7", "attention-1"));            // not its claim: kept
  EXPECT_EQ(owners.size(), 1u);
  EXPECT_TRUE(owners.Forget("7", "attention-0"));
  EXPECT_EQ(owners.size(), 0u);
  EXPECT_TRUE(owners.Check("7", "attention-1", "sequence").ok());
}

// The race the claim closes: a create of an id in progress, a duplicate create of it, and a
// release of it. Before, the duplicate was let through, and when the first create failed its
// Forget left the duplicate's sequence without an owner (anyone could then release it).
TEST(OwnerTableTest, APendingClaimRefusesADuplicateAndOutlivesARelease) {
  OwnerTable owners;
  {
    absl::StatusOr<OwnerTable::Claim> first = owners.Acquire("7", "attention-0", "sequence");
    ASSERT_TRUE(first.ok());
    const absl::StatusOr<OwnerTable::Claim> duplicate =
        owners.Acquire("7", "attention-0", "sequence");
    EXPECT_EQ(duplicate.status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(duplicate.status().message(), "sequence 7 is being created by another call");
    EXPECT_EQ(owners.Acquire("7", "attention-1", "sequence").status().code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_FALSE(owners.Forget("7", "attention-0"));  // a Release during the create
    EXPECT_EQ(owners.Check("7", "attention-1", "sequence").code(),
              absl::StatusCode::kPermissionDenied);
  }  // the create failed: no Keep
  EXPECT_EQ(owners.size(), 0u);
  EXPECT_TRUE(owners.Acquire("7", "attention-1", "sequence").ok());  // free again
  // A claim moved keeps one owner: the moved-from one forgets nothing.
  absl::StatusOr<OwnerTable::Claim> held = owners.Acquire("8", "attention-0", "sequence");
  OwnerTable::Claim moved = *std::move(held);
  held = OwnerTable::Claim();
  EXPECT_EQ(owners.size(), 1u);
  moved.Keep();
  EXPECT_EQ(owners.size(), 1u);
  EXPECT_EQ(owners.Check("8", "attention-1", "sequence").code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(CredentialsTest, RefusesIncompleteOrUnreadableSettings) {
  TlsFlags half;
  half.cert_file = "/some/cert.pem";
  EXPECT_EQ(ServerCredentialsFrom(half).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClientSecurityFrom(half).status().code(), absl::StatusCode::kInvalidArgument);
  TlsFlags client_ca_only;
  client_ca_only.client_ca_file = "/some/ca.pem";
  EXPECT_THAT(ServerCredentialsFrom(client_ca_only).status().message(),
              HasSubstr("--tls-client-ca needs --tls-cert"));
  TlsFlags missing;
  missing.cert_file = "/nonexistent/cert.pem";
  missing.key_file = "/nonexistent/key.pem";
  const absl::Status unreadable = ServerCredentialsFrom(missing).status();
  EXPECT_EQ(unreadable.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unreadable.message(), HasSubstr("--tls-cert: cannot read /nonexistent/cert.pem"));

  // A token or a server name never goes out without TLS.
  EXPECT_THAT(ClientSecurityFrom(TlsFlags(), "secret").status().message(),
              HasSubstr("a bearer token needs --tls-ca"));
  TlsFlags name_only;
  name_only.server_name = "indexer-0";
  EXPECT_EQ(ClientSecurityFrom(name_only).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<ClientSecurity> plaintext = ClientSecurityFrom(TlsFlags());
  ASSERT_TRUE(plaintext.ok());
  EXPECT_FALSE(plaintext->tls());

  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  TlsFlags trusting;
  trusting.ca_file = pki.ca();
  const absl::StatusOr<ClientSecurity> tls = ClientSecurityFrom(trusting, "secret");
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_TRUE(tls->tls());
}

// Whether a new connection with `security` to `address` comes up (its TLS handshake passes)
// within half a second. A new channel with its own subchannel pool, so that no connection made
// before is reused.
bool Connects(const std::string& address, const ClientSecurity& security) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel = NewChannel(address, security, arguments);
  return channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
}

// Whether new connections come to `connect` (true: come up; false: fail) within `within`: tries
// again until one does (a file watcher reads renewed files within its interval).
bool Eventually(bool connect, const std::string& address, const ClientSecurity& security,
                absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  do {
    if (Connects(address, security) == connect) return true;
  } while (absl::Now() < deadline);
  return false;
}

// Puts `from`'s certificate and key in `to`'s files as a renewal does: each file written beside
// and renamed over the old one (a reload may still read the new certificate with the old key).
void Install(const testing::TestIdentity& from, const testing::TestIdentity& to) {
  const auto overwrite = std::filesystem::copy_options::overwrite_existing;
  for (const auto& [source, target] :
       {std::pair{from.cert, to.cert}, std::pair{from.key, to.key}}) {
    std::filesystem::copy_file(source, target + ".new", overwrite);
    std::filesystem::rename(target + ".new", target);
  }
}

// A renewed certificate is used without a restart, on both sides: the server and the client
// re-read their files every tls_reload_interval_s and new connections use what the files hold.
// The server's certificate must hold the dialed name or the client's server_name.
TEST(CredentialsTest, RenewedCertificatesAreUsedOnNewConnectionsWithoutARestart) {
  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  const testing::TestIdentity server_cert = pki.Issue("server");
  const testing::TestIdentity client_cert = pki.Issue("client");
  const testing::TestIdentity foreign_server = pki.Issue("server", /*by_wrong_ca=*/true);
  const testing::TestIdentity foreign_client = pki.Issue("client", /*by_wrong_ca=*/true);
  ASSERT_FALSE(foreign_client.cert.empty());
  const testing::TestIdentity served{pki.dir() + "/served.crt", pki.dir() + "/served.key"};
  const testing::TestIdentity shown{pki.dir() + "/shown.crt", pki.dir() + "/shown.key"};
  Install(server_cert, served);
  Install(foreign_client, shown);  // a client certificate the server's CA did not sign

  TlsFlags server_flags;
  server_flags.cert_file = served.cert;
  server_flags.key_file = served.key;
  server_flags.client_ca_file = pki.ca();
  server_flags.tls_reload_interval_s = 1;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFrom(server_flags);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  dsa::indexer::v1::IndexerService::Service unimplemented;  // a port needs a service
  std::string address;
  std::unique_ptr<grpc::Server> server =
      testing::ServeOnLoopback(&unimplemented, &address, *credentials);
  ASSERT_NE(server, nullptr);

  TlsFlags client_flags;
  client_flags.ca_file = pki.ca();
  client_flags.cert_file = shown.cert;
  client_flags.key_file = shown.key;
  client_flags.tls_reload_interval_s = 1;
  absl::StatusOr<ClientSecurity> client = ClientSecurityFrom(client_flags);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE(Connects(address, *client));  // refused: the foreign client certificate
  // The client's certificate is renewed by its CA: the client reads it within a second or so.
  Install(client_cert, shown);
  EXPECT_TRUE(Eventually(true, address, *client, absl::Seconds(20)));
  // The server's is replaced by one of another CA: new connections fail once it is read, and go
  // on failing after two more reloads (so not because a reload read the new certificate with the
  // old key)...
  Install(foreign_server, served);
  EXPECT_TRUE(Eventually(false, address, *client, absl::Seconds(20)))
      << "the server kept serving its old certificate";
  absl::SleepFor(absl::Seconds(2));
  EXPECT_FALSE(Connects(address, *client));
  // ... and come up again when it is renewed.
  Install(server_cert, served);
  EXPECT_TRUE(Eventually(true, address, *client, absl::Seconds(20)));

  // The name check: the certificate holds localhost and 127.0.0.1, not another name.
  client_flags.server_name = "localhost";
  EXPECT_TRUE(Connects(address, *ClientSecurityFrom(client_flags)));
  client_flags.server_name = "indexer-0.elsewhere";
  EXPECT_FALSE(Connects(address, *ClientSecurityFrom(client_flags)));
  server->Shutdown();
}

// A readable file that holds no certificate, or a key that is not the certificate's, fails at
// start (gRPC's file watcher would take them, and every handshake would fail).
TEST(CredentialsTest, AWrongCertificateOrKeyFailsAtStart) {
  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  const testing::TestIdentity a = pki.Issue("a");
  const testing::TestIdentity b = pki.Issue("b");
  TlsFlags mismatched;
  mismatched.cert_file = a.cert;
  mismatched.key_file = b.key;
  EXPECT_EQ(ServerCredentialsFrom(mismatched).status().message(),
            absl::StrCat("--tls-key: ", b.key, " is not the private key of --tls-cert ", a.cert));
  mismatched.ca_file = pki.ca();
  EXPECT_EQ(ClientSecurityFrom(mismatched).status().code(), absl::StatusCode::kInvalidArgument);
  TlsFlags not_pem;
  not_pem.cert_file = pki.Write("garbage.crt", "not a certificate\n");
  not_pem.key_file = a.key;
  EXPECT_EQ(ServerCredentialsFrom(not_pem).status().message(),
            absl::StrCat("--tls-cert: ", not_pem.cert_file, " holds no PEM certificate"));
  TlsFlags bad_ca;
  bad_ca.ca_file = pki.Write("garbage-ca.crt", "");
  EXPECT_EQ(ClientSecurityFrom(bad_ca).status().message(),
            absl::StrCat("--tls-ca: ", bad_ca.ca_file, " holds no PEM certificate"));
  TlsFlags good;
  good.cert_file = a.cert;
  good.key_file = a.key;
  good.client_ca_file = pki.ca();
  EXPECT_TRUE(ServerCredentialsFrom(good).ok());
}

// The bytes of `path` ("" when it cannot be read).
std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Overwrites `path` in place with `bytes` (truncate, then write), as a careless renewal does.
void Overwrite(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The stager hands gRPC only files that pass the check: an emptied certificate, one cut short,
// one whose key has not arrived yet and a deleted file leave the last good files staged; the
// whole renewed pair is staged; the folder goes with the stager.
TEST(TlsFileStagerTest, FilesThatFailTheCheckLeaveTheLastGoodOnesStaged) {
  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  const testing::TestIdentity a = pki.Issue("a");
  const testing::TestIdentity b = pki.Issue("b");
  ASSERT_FALSE(b.cert.empty());
  const testing::TestIdentity served{pki.dir() + "/served.crt", pki.dir() + "/served.key"};
  Install(a, served);
  const std::string roots = pki.dir() + "/roots.crt";
  std::filesystem::copy_file(pki.ca(), roots);
  auto stager = TlsFileStager::Start(
      {.key_file = served.key, .cert_file = served.cert, .root_file = roots}, absl::ZeroDuration());
  ASSERT_TRUE(stager.ok()) << stager.status();
  const TlsFileStager::Files staged = (*stager)->staged();
  EXPECT_EQ((*stager)->generation(), 1);
  EXPECT_EQ(Slurp(staged.cert_file), Slurp(a.cert));
  EXPECT_EQ(Slurp(staged.key_file), Slurp(a.key));
  EXPECT_EQ(Slurp(staged.root_file), Slurp(pki.ca()));
  EXPECT_EQ(
      std::filesystem::status((*stager)->folder()).permissions() & std::filesystem::perms::all,
      std::filesystem::perms::owner_all);
  EXPECT_TRUE((*stager)->Refresh().ok());  // unchanged
  EXPECT_EQ((*stager)->generation(), 1);

  const std::string a_cert = Slurp(a.cert);
  struct Case {
    const char* what;
    std::string cert;
    std::string message;
  };
  const std::vector<Case> refused = {
      {"empty", "", " holds no PEM certificate"},
      {"cut short", a_cert.substr(0, a_cert.size() / 2), " holds no PEM certificate"},
      {"b's certificate before b's key", Slurp(b.cert), " is not the private key of --tls-cert "},
  };
  for (const Case& c : refused) {
    Overwrite(served.cert, c.cert);
    const absl::Status status = (*stager)->Refresh();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr(c.message)) << c.what;
    EXPECT_EQ((*stager)->generation(), 1) << c.what;
    EXPECT_EQ(Slurp(staged.cert_file), a_cert) << c.what;
  }
  Overwrite(served.cert, a_cert);
  Overwrite(roots, "");
  EXPECT_THAT((*stager)->Refresh().message(), HasSubstr("--tls-ca: " + roots));
  std::filesystem::copy_file(pki.ca(), roots, std::filesystem::copy_options::overwrite_existing);
  Overwrite(served.cert, Slurp(b.cert));
  std::filesystem::remove(served.key);
  EXPECT_EQ((*stager)->Refresh().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Slurp(staged.key_file), Slurp(a.key));

  // b's key arrives: the pair is staged, through the same paths, even over what a failed
  // attempt left (a version folder made, its files not all written).
  std::filesystem::copy_file(b.key, served.key);
  std::filesystem::create_directory((*stager)->folder() + "/v2");
  Overwrite((*stager)->folder() + "/v2/key.pem", "partial");
  ASSERT_TRUE((*stager)->Refresh().ok());
  EXPECT_EQ((*stager)->generation(), 2);
  EXPECT_EQ(Slurp(staged.cert_file), Slurp(b.cert));
  EXPECT_EQ(Slurp(staged.key_file), Slurp(b.key));
  Install(a, served);
  ASSERT_TRUE((*stager)->Refresh().ok());
  EXPECT_EQ((*stager)->generation(), 3);
  EXPECT_EQ(Slurp(staged.cert_file), a_cert);

  // Memory first: the copies hold the private key.
  if (::access("/dev/shm", W_OK) == 0) {
    EXPECT_EQ((*stager)->folder().rfind("/dev/shm/", 0), 0u) << (*stager)->folder();
  }

  // Stopped (the process's exit): no more refreshes, the folder is gone.
  (*stager)->Stop();
  EXPECT_FALSE(std::filesystem::exists((*stager)->folder()));
  Install(b, served);
  EXPECT_EQ((*stager)->Refresh().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(std::filesystem::exists((*stager)->folder()));
  auto other = TlsFileStager::Start(
      {.key_file = served.key, .cert_file = served.cert, .root_file = ""}, absl::ZeroDuration());
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string folder = (*other)->folder();
  EXPECT_TRUE(std::filesystem::exists(folder));
  other->reset();
  EXPECT_FALSE(std::filesystem::exists(folder));
}

// End to end: a server whose certificate file is emptied, then overwritten with another CA's
// certificate before its key, goes on serving its last good certificate (gRPC's file watcher alone
// took the wrong pair, and every handshake failed until it was right; an empty file could abort
// the process). The renewed pair is then taken (new connections refused: another CA's).
TEST(CredentialsTest, AnEmptyOrHalfRenewedCertificateAtAReloadLeavesTheLastGoodOneServed) {
  testing::TestPki pki;
  ASSERT_TRUE(pki.ok());
  const testing::TestIdentity server_cert = pki.Issue("server");
  const testing::TestIdentity foreign = pki.Issue("server", /*by_wrong_ca=*/true);
  ASSERT_FALSE(foreign.cert.empty());
  const testing::TestIdentity served{pki.dir() + "/served.crt", pki.dir() + "/served.key"};
  Install(server_cert, served);
  TlsFlags server_flags;
  server_flags.cert_file = served.cert;
  server_flags.key_file = served.key;
  server_flags.tls_reload_interval_s = 1;
  auto credentials = ServerCredentialsFrom(server_flags);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  dsa::indexer::v1::IndexerService::Service unimplemented;
  std::string address;
  std::unique_ptr<grpc::Server> server =
      testing::ServeOnLoopback(&unimplemented, &address, *credentials);
  ASSERT_NE(server, nullptr);
  TlsFlags client_flags;
  client_flags.ca_file = pki.ca();
  absl::StatusOr<ClientSecurity> client = ClientSecurityFrom(client_flags);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Eventually(true, address, *client, absl::Seconds(5)));
  for (const std::string& cert : {std::string(), Slurp(foreign.cert)}) {
    Overwrite(served.cert, cert);
    absl::SleepFor(absl::Milliseconds(2500));  // two reloads of the stager and of gRPC's watcher
    EXPECT_TRUE(Eventually(true, address, *client, absl::Seconds(5)))
        << "after a reload read " << cert.size() << " bytes";
  }
  Install(foreign, served);
  EXPECT_TRUE(Eventually(false, address, *client, absl::Seconds(20)))
      << "the renewed pair was not taken";
  server->Shutdown();
}

TEST(CredentialsTest, AReloadIntervalBelowOneSecondIsRefused) {
  TlsFlags flags;
  flags.tls_reload_interval_s = 0;
  EXPECT_EQ(ServerCredentialsFrom(flags).status().message(),
            "--tls-reload-interval-s must be >= 1, got 0");
  EXPECT_EQ(ClientSecurityFrom(flags).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CredentialsTest, TokenFilesHoldOneToken) {
  testing::TestPki pki;
  EXPECT_EQ(ReadTokenFile(pki.Write("t1", "  abc123\n")).value(), "abc123");
  EXPECT_EQ(ReadTokenFile(pki.Write("t2", "\n\n")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ReadTokenFile(pki.Write("t3", "abc def\n")).status().message(),
              HasSubstr("one token only"));
  EXPECT_EQ(ReadTokenFile("/nonexistent/token").status().code(), absl::StatusCode::kNotFound);
}

TEST(OnlyIndexerWorkersTest, DialsOnlyConfiguredAddressesAndResolvedNames) {
  std::vector<std::string> dialed;
  IndexerClientFactory inner =
      [&dialed](const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    dialed.push_back(address);
    return absl::UnimplementedError("the fake factory makes no client");
  };
  int resolutions = 0;
  AddressResolver resolve =
      [&resolutions](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    ++resolutions;
    if (name == "indexer.ns:50052") return std::vector<std::string>{"10.0.0.5:50052"};
    if (name == "flaky.ns:50052") return absl::UnavailableError("temporary failure");
    return absl::NotFoundError("cannot resolve");
  };
  IndexerClientFactory only = OnlyIndexerWorkers(inner, {"indexer-0:50052"},
                                                 {"indexer.ns:50052", "gone.ns:50052"}, resolve);
  EXPECT_EQ(only("indexer-0:50052").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(resolutions, 0);  // a fixed address needs no lookup
  EXPECT_EQ(only("10.0.0.5:50052").status().code(), absl::StatusCode::kUnimplemented);
  const absl::Status refused = only("10.0.0.6:50052").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(
      refused.message(),
      "indexer worker 10.0.0.6:50052 is not one this attention worker is configured with "
      "(--indexer-workers [indexer-0:50052], --indexer-dns [indexer.ns:50052,gone.ns:50052])");
  EXPECT_EQ(dialed, (std::vector<std::string>{"indexer-0:50052", "10.0.0.5:50052"}));

  // A name whose lookup failed for now: UNAVAILABLE (retry), not a refusal.
  IndexerClientFactory flaky = OnlyIndexerWorkers(inner, {}, {"flaky.ns:50052"}, resolve);
  EXPECT_EQ(flaky("10.0.0.7:50052").status().code(), absl::StatusCode::kUnavailable);

  // Neither list: any address (the worker logs a warning at start).
  IndexerClientFactory any = OnlyIndexerWorkers(inner, {}, {}, resolve);
  EXPECT_EQ(any("anywhere:1").status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace dsa
