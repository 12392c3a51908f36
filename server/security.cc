#include "server/security.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "openssl/bio.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace dsa {
namespace {

// The bytes of `path`, read for `flag`.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    const int error = errno;
    const std::string message =
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(message);
    if (error == EACCES) return absl::PermissionDeniedError(message);
    return absl::FailedPreconditionError(message);
  }
  std::string bytes;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file)) > 0) bytes.append(buffer, n);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return absl::FailedPreconditionError(absl::StrCat(flag, ": cannot read ", path));
  return bytes;
}

absl::Status CheckPair(const TlsFlags& flags) {
  if (flags.cert_file.empty() != flags.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together: one names a file, the other is empty");
  }
  if (flags.tls_reload_interval_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-reload-interval-s must be >= 1, got ", flags.tls_reload_interval_s));
  }
  return absl::OkStatus();
}

struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// The first PEM certificate of `pem`; null when it holds none.
X509Ptr ParseCertificate(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  X509Ptr cert(PEM_read_bio_X509(bio, nullptr, nullptr, nullptr));
  BIO_free(bio);
  return cert;
}

// The PEM private key of `pem`; null when it holds none.
PkeyPtr ParsePrivateKey(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  PkeyPtr key(PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr));
  BIO_free(bio);
  return key;
}

// The first certificate of the PEM file `path` (read for `flag`); INVALID_ARGUMENT when it holds
// none, ReadFile's errors when it cannot be read.
absl::StatusOr<X509Ptr> ReadCertificate(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> pem = ReadFile(path, flag);
  if (!pem.ok()) return pem.status();
  X509Ptr cert = ParseCertificate(*pem);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM certificate"));
  }
  return cert;
}

// Checks that `cert_file` holds a PEM certificate and `key_file` the private key of that
// certificate, so that a wrong file fails the start: gRPC's file watcher does not parse them, and
// every handshake would fail while the plaintext health port says SERVING.
absl::Status CheckKeyPair(const std::string& cert_file, const std::string& key_file) {
  absl::StatusOr<X509Ptr> cert = ReadCertificate(cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key_pem = ReadFile(key_file, "--tls-key");
  if (!key_pem.ok()) return key_pem.status();
  PkeyPtr key = ParsePrivateKey(*key_pem);
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", key_file, " holds no PEM private key"));
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", key_file, " is not the private key of --tls-cert ", cert_file));
  }
  return absl::OkStatus();
}

// Checks that `ca_file` (read for `flag`) holds at least one PEM certificate.
absl::Status CheckCaBundle(const std::string& ca_file, absl::string_view flag) {
  return ReadCertificate(ca_file, flag).status();
}

// Watches the files (empty paths: not watched) and re-reads them every `interval_s`.
std::shared_ptr<grpc::experimental::CertificateProviderInterface> WatchFiles(
    const std::string& key_file, const std::string& cert_file, const std::string& root_file,
    int interval_s) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      key_file, cert_file, root_file, static_cast<unsigned int>(interval_s));
}

// Constant-time equality of two strings of any length (the length itself is not secret).
bool SameBytes(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return difference == 0;
}

constexpr absl::string_view kBearerPrefix = "Bearer ";

}  // namespace

void AddTlsFlags(CLI::App& app, TlsFlags& flags, bool serves) {
  app.add_option("--tls-cert", flags.cert_file,
                 serves ? "Certificate chain (PEM) the gRPC port serves TLS with; also shown as "
                          "the client certificate when this process dials (mutual TLS)"
                        : "Client certificate chain (PEM) shown to the server (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", flags.key_file, "Private key (PEM) of --tls-cert")
      ->check(CLI::ExistingFile);
  if (serves) {
    app.add_option("--tls-client-ca", flags.client_ca_file,
                   "CA bundle (PEM): the gRPC port requires client certificates chained to it "
                   "(mutual TLS; needs --tls-cert)")
        ->check(CLI::ExistingFile);
  }
  app.add_option("--tls-ca", flags.ca_file,
                 "CA bundle (PEM) of the servers this process dials; set = dial with TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-server-name", flags.server_name,
                 "Name checked in dialed servers' certificates instead of the address's host");
  app.add_option("--tls-reload-interval-s", flags.tls_reload_interval_s,
                 "How often the TLS files are read again (seconds): a renewed certificate is "
                 "used on new connections without a restart")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(
    const TlsFlags& flags) {
  if (absl::Status pair = CheckPair(flags); !pair.ok()) return pair;
  if (flags.cert_file.empty()) {
    if (!flags.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first");
    }
    return grpc::InsecureServerCredentials();
  }
  if (absl::Status pair = CheckKeyPair(flags.cert_file, flags.key_file); !pair.ok()) return pair;
  if (!flags.client_ca_file.empty()) {
    if (absl::Status ca = CheckCaBundle(flags.client_ca_file, "--tls-client-ca"); !ca.ok()) {
      return ca;
    }
  }
  grpc::experimental::TlsServerCredentialsOptions options(WatchFiles(
      flags.key_file, flags.cert_file, flags.client_ca_file, flags.tls_reload_interval_s));
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!flags.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<ClientSecurity> ClientSecurityFrom(const TlsFlags& flags,
                                                  const std::string& bearer_token) {
  if (absl::Status pair = CheckPair(flags); !pair.ok()) return pair;
  ClientSecurity security;
  if (flags.ca_file.empty()) {
    if (!bearer_token.empty()) {
      return absl::InvalidArgumentError(
          "a bearer token needs --tls-ca: it would cross the network in plaintext");
    }
    if (!flags.server_name.empty()) {
      return absl::InvalidArgumentError("--tls-server-name needs --tls-ca (TLS to dial with)");
    }
    return security;  // plaintext; a client certificate here only serves this process's port
  }
  if (absl::Status ca = CheckCaBundle(flags.ca_file, "--tls-ca"); !ca.ok()) return ca;
  if (!flags.cert_file.empty()) {
    if (absl::Status pair = CheckKeyPair(flags.cert_file, flags.key_file); !pair.ok()) return pair;
  }
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(
      WatchFiles(flags.key_file, flags.cert_file, flags.ca_file, flags.tls_reload_interval_s));
  options.watch_root_certs();
  if (!flags.cert_file.empty()) options.watch_identity_key_cert_pairs();
  // The server's certificate must chain to ca_file and hold the name dialed (or server_name).
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  security.credentials = grpc::experimental::TlsCredentials(options);
  if (!bearer_token.empty()) {
    security.credentials = grpc::CompositeChannelCredentials(
        security.credentials, grpc::AccessTokenCredentials(bearer_token));
  }
  security.server_name = flags.server_name;
  return security;
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          const ClientSecurity& security,
                                          grpc::ChannelArguments arguments) {
  if (!security.tls()) {
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), arguments);
  }
  if (!security.server_name.empty()) arguments.SetSslTargetNameOverride(security.server_name);
  return grpc::CreateCustomChannel(address, security.credentials, arguments);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path, "--token-file");
  if (!bytes.ok()) return bytes.status();
  std::string token(absl::StripAsciiWhitespace(*bytes));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--token-file: ", path, " is empty"));
  }
  if (token.find_first_of(" \t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token-file: ", path, " holds more than one word (one token only)"));
  }
  return token;
}

BearerTokenAuthenticator::BearerTokenAuthenticator(
    std::vector<std::pair<std::string, std::string>> tokens)
    : clients_by_token_(std::move(tokens)) {}

absl::StatusOr<std::shared_ptr<BearerTokenAuthenticator>> BearerTokenAuthenticator::Parse(
    absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_number, ": expected \"CLIENT TOKEN\" (two fields), found ", fields.size()));
    }
    for (const auto& [token, client] : tokens) {
      if (token == fields[1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "line ", line_number, ": the token of ", fields[0], " is also the token of ", client));
      }
      if (client == fields[0]) {
        return absl::InvalidArgumentError(
            absl::StrCat("line ", line_number, ": client ", fields[0], " is listed twice"));
      }
    }
    tokens.emplace_back(std::string(fields[1]), std::string(fields[0]));
  }
  if (tokens.empty()) return absl::InvalidArgumentError("no \"CLIENT TOKEN\" line");
  return std::shared_ptr<BearerTokenAuthenticator>(new BearerTokenAuthenticator(std::move(tokens)));
}

absl::StatusOr<std::shared_ptr<BearerTokenAuthenticator>> BearerTokenAuthenticator::Load(
    const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path, "--auth-tokens-file");
  if (!text.ok()) return text.status();
  auto parsed = Parse(*text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens-file ", path, ": ", parsed.status().message()));
  }
  return parsed;
}

grpc::Status BearerTokenAuthenticator::Process(const InputMetadata& auth_metadata,
                                               grpc::AuthContext* context,
                                               OutputMetadata* consumed_auth_metadata,
                                               OutputMetadata* /*response_metadata*/) {
  const auto header = auth_metadata.find("authorization");
  if (header == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing bearer token (authorization: Bearer TOKEN)");
  }
  absl::string_view value(header->second.data(), header->second.size());
  // The scheme is case-insensitive (RFC 7235 section 2.1).
  if (!absl::StartsWithIgnoreCase(value, kBearerPrefix)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the authorization header is not \"Bearer TOKEN\"");
  }
  value.remove_prefix(kBearerPrefix.size());
  const std::string* client = nullptr;
  for (const auto& [token, name] : clients_by_token_) {
    if (SameBytes(token, value) && client == nullptr) client = &name;  // every token compared
  }
  if (client == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown bearer token");
  }
  context->AddProperty(kTokenClientProperty, *client);
  consumed_auth_metadata->insert(
      {"authorization", std::string(header->second.data(), header->second.size())});
  return grpc::Status::OK;
}

std::string CallerIdentity(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return "";
  for (const grpc::string_ref& client : auth->FindPropertyValues(kTokenClientProperty)) {
    return std::string(client.data(), client.size());
  }
  if (!auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& name : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    return std::string(name.data(), name.size());
  }
  for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
    return std::string(name.data(), name.size());
  }
  return "";
}

OwnerTable::OwnerTable(std::vector<std::string> operators) : operators_(std::move(operators)) {}

bool OwnerTable::IsOperator(const std::string& caller) const {
  return std::find(operators_.begin(), operators_.end(), caller) != operators_.end();
}

OwnerTable::Claim::Claim(Claim&& other) noexcept
    : table_(std::exchange(other.table_, nullptr)), id_(std::move(other.id_)) {}

OwnerTable::Claim& OwnerTable::Claim::operator=(Claim&& other) noexcept {
  if (this != &other) {
    Drop();
    table_ = std::exchange(other.table_, nullptr);
    id_ = std::move(other.id_);
  }
  return *this;
}

OwnerTable::Claim::~Claim() { Drop(); }

void OwnerTable::Claim::Keep() {
  if (table_ == nullptr) return;
  absl::MutexLock lock(&table_->mu_);
  table_->owners_.at(id_).pending = false;  // only this claim erases a pending entry
  table_ = nullptr;
}

void OwnerTable::Claim::Drop() {
  if (table_ == nullptr) return;
  absl::MutexLock lock(&table_->mu_);
  table_->owners_.erase(id_);
  table_ = nullptr;
}

absl::StatusOr<OwnerTable::Claim> OwnerTable::Acquire(const std::string& id,
                                                      const std::string& caller,
                                                      absl::string_view what) {
  absl::MutexLock lock(&mu_);
  const auto [owner, inserted] = owners_.emplace(id, Owner{caller, /*pending=*/true});
  if (inserted) return Claim(this, id);
  if (owner->second.caller != caller && !IsOperator(caller)) {
    return absl::PermissionDeniedError(absl::StrCat(what, " ", id, " belongs to another caller"));
  }
  if (owner->second.pending) {
    return absl::AlreadyExistsError(
        absl::StrCat(what, " ", id, " is being created by another call"));
  }
  return Claim();
}

absl::Status OwnerTable::Check(const std::string& id, const std::string& caller,
                               absl::string_view what) const {
  if (IsOperator(caller)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  const auto owner = owners_.find(id);
  if (owner == owners_.end() || owner->second.caller == caller) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, " ", id, " belongs to another caller"));
}

bool OwnerTable::Forget(const std::string& id, const std::string& caller) {
  absl::MutexLock lock(&mu_);
  const auto owner = owners_.find(id);
  if (owner == owners_.end() || owner->second.pending ||
      (owner->second.caller != caller && !IsOperator(caller))) {
    return false;
  }
  owners_.erase(owner);
  return true;
}

size_t OwnerTable::size() const {
  absl::MutexLock lock(&mu_);
  return owners_.size();
}

}  // namespace dsa
