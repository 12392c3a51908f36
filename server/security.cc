#include "server/security.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "server/log.h"

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

// Checks that `pem` (the file `path`, read for `flag`) holds PEM certificates and that every
// "BEGIN CERTIFICATE" block in it parses (a file cut short in the middle of a rewrite fails here):
// INVALID_ARGUMENT naming the flag and path otherwise.
absl::Status CheckCertificates(const std::string& pem, absl::string_view flag,
                               const std::string& path) {
  constexpr std::string_view kBegin = "-----BEGIN CERTIFICATE-----";
  int blocks = 0;
  for (size_t at = pem.find(kBegin); at != std::string::npos; at = pem.find(kBegin, at + 1)) {
    ++blocks;
  }
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  int parsed = 0;
  while (X509Ptr cert{PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)}) ++parsed;
  BIO_free(bio);
  if (parsed == 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM certificate"));
  }
  if (parsed != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds a certificate block that does not parse"));
  }
  return absl::OkStatus();
}

// Checks the bytes read from `files` (key, cert, roots): Start's INVALID_ARGUMENT cases.
absl::Status CheckPem(const TlsFileStager::Files& files, const std::string& key,
                      const std::string& cert, const std::string& roots) {
  // The parses leave errors on this thread's OpenSSL queue (a read past the last certificate:
  // "no start line"); they are dropped on return, and errors queued before are kept.
  struct ErrorMark {
    ErrorMark() { ERR_set_mark(); }
    ~ErrorMark() { ERR_pop_to_mark(); }
    ErrorMark(const ErrorMark&) = delete;
    ErrorMark& operator=(const ErrorMark&) = delete;
  } mark;
  if (!files.key_file.empty() && files.cert_file.empty()) {
    return absl::InvalidArgumentError("--tls-key needs --tls-cert");
  }
  if (!files.cert_file.empty()) {
    if (absl::Status certificates = CheckCertificates(cert, "--tls-cert", files.cert_file);
        !certificates.ok()) {
      return certificates;
    }
    if (!files.key_file.empty()) {
      const X509Ptr leaf = ParseCertificate(cert);
      PkeyPtr private_key = ParsePrivateKey(key);
      if (private_key == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("--tls-key: ", files.key_file, " holds no PEM private key"));
      }
      if (X509_check_private_key(leaf.get(), private_key.get()) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", files.key_file,
                                                       " is not the private key of --tls-cert ",
                                                       files.cert_file));
      }
    }
  }
  if (!files.root_file.empty()) {
    return CheckCertificates(roots, files.root_flag, files.root_file);
  }
  return absl::OkStatus();
}

// Reads the files of `files` that are named (cert, then key, then roots).
absl::Status ReadSources(const TlsFileStager::Files& files, std::string* key, std::string* cert,
                         std::string* roots) {
  for (auto [path, flag, bytes] :
       {std::tuple{&files.cert_file, absl::string_view("--tls-cert"), cert},
        std::tuple{&files.key_file, absl::string_view("--tls-key"), key},
        std::tuple{&files.root_file, absl::string_view(files.root_flag), roots}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> read = ReadFile(*path, flag);
    if (!read.ok()) return read.status();
    *bytes = *std::move(read);
  }
  return absl::OkStatus();
}

// Writes `bytes` to the new file `path`, readable by this user only.
absl::Status WriteNewFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(error)));
    }
    written += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// The stagers behind the process's credentials, kept until the process exits: gRPC reads their
// files for as long as the credentials it made live, which no call here sees the end of. Their
// folders are removed at exit.
absl::Mutex kept_mu(absl::kConstInit);
std::vector<std::unique_ptr<TlsFileStager>>* kept_stagers ABSL_GUARDED_BY(kept_mu) = nullptr;

void RemoveKeptFolders() {
  absl::MutexLock lock(&kept_mu);
  for (const auto& stager : *kept_stagers) stager->Stop();
}

TlsFileStager::Files Keep(std::unique_ptr<TlsFileStager> stager) {
  TlsFileStager::Files staged = stager->staged();
  absl::MutexLock lock(&kept_mu);
  if (kept_stagers == nullptr) {
    kept_stagers = new std::vector<std::unique_ptr<TlsFileStager>>();
    std::atexit(RemoveKeptFolders);
  }
  kept_stagers->push_back(std::move(stager));
  return staged;
}

// Checked copies of `files`, re-read every `interval_s`, watched by gRPC's file watcher at the
// same interval.
absl::StatusOr<std::shared_ptr<grpc::experimental::CertificateProviderInterface>> WatchFiles(
    const TlsFileStager::Files& files, int interval_s) {
  absl::StatusOr<std::unique_ptr<TlsFileStager>> stager =
      TlsFileStager::Start(files, absl::Seconds(interval_s));
  TlsFileStager::Files watched = files;
  if (stager.ok()) {
    watched = Keep(*std::move(stager));
  } else if (stager.status().code() == absl::StatusCode::kInternal) {
    // No folder to stage in (a read-only file system without /dev/shm or /tmp): the files,
    // checked once by Start, are watched directly, as gRPC alone does.
    LogJson("warn", "TLS files watched without checks at reload: no folder for checked copies",
            {{"status", stager.status().ToString()}});
  } else {
    return stager.status();
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      watched.key_file, watched.cert_file, watched.root_file,
      static_cast<unsigned int>(interval_s));
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

TlsFileStager::TlsFileStager(Files sources, std::string dir)
    : sources_(std::move(sources)), dir_(std::move(dir)) {
  const std::string current = dir_ + "/current/";
  staged_.key_file = sources_.key_file.empty() ? "" : current + "key.pem";
  staged_.cert_file = sources_.cert_file.empty() ? "" : current + "cert.pem";
  staged_.root_file = sources_.root_file.empty() ? "" : current + "roots.pem";
  staged_.root_flag = sources_.root_flag;
}

absl::StatusOr<std::unique_ptr<TlsFileStager>> TlsFileStager::Start(const Files& sources,
                                                                    absl::Duration interval) {
  // The files are checked before any folder is made, so that a wrong file is named as such.
  {
    std::string key, cert, roots;
    if (absl::Status read = ReadSources(sources, &key, &cert, &roots); !read.ok()) return read;
    if (absl::Status checked = CheckPem(sources, key, cert, roots); !checked.ok()) return checked;
  }
  // Memory first (the pods' /dev/shm is a Memory emptyDir): the copies hold the private key.
  std::vector<std::string> parents = {"/dev/shm"};
  if (const char* tmp = std::getenv("TMPDIR"); tmp != nullptr && *tmp != '\0') {
    parents.emplace_back(tmp);
  }
  parents.emplace_back("/tmp");
  std::string folder;
  std::string refused;
  for (const std::string& parent : parents) {
    std::string pattern = parent + "/dsa-tls-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) {
      folder = pattern;
      break;
    }
    absl::StrAppend(&refused, refused.empty() ? "" : "; ", parent, ": ", std::strerror(errno));
  }
  if (folder.empty()) {
    return absl::InternalError(absl::StrCat("no folder for the checked TLS files (", refused, ")"));
  }
  std::unique_ptr<TlsFileStager> stager(new TlsFileStager(sources, folder));
  if (absl::Status first = stager->Refresh(); !first.ok()) return first;  // the folder goes too
  if (interval > absl::ZeroDuration()) {
    stager->thread_ = std::thread([s = stager.get(), interval] { s->Run(interval); });
  }
  return stager;
}

TlsFileStager::~TlsFileStager() { Stop(); }

void TlsFileStager::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  // The thread wakes at once (it waits for stop_); ending it here also ends its OpenSSL state,
  // which a thread still running at exit would leave behind.
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

int64_t TlsFileStager::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

absl::Status TlsFileStager::Refresh() {
  absl::MutexLock refreshing(&refresh_mu_);  // one read and stage at a time, in order
  std::string key, cert, roots;
  if (absl::Status read = ReadSources(sources_, &key, &cert, &roots); !read.ok()) return read;
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::CancelledError("the TLS file stager was stopped");
  if (generation_ > 0 && key == key_ && cert == cert_ && roots == roots_) return absl::OkStatus();
  if (absl::Status checked = CheckPem(sources_, key, cert, roots); !checked.ok()) return checked;
  return StageLocked(key, cert, roots);
}

absl::Status TlsFileStager::StageLocked(const std::string& key, const std::string& cert,
                                        const std::string& roots) {
  const int64_t next = generation_ + 1;
  const std::string version = absl::StrCat("v", next);
  const std::string folder = absl::StrCat(dir_, "/", version);
  std::error_code ignored;
  std::filesystem::remove_all(folder, ignored);  // what an earlier failed attempt left
  auto failed = [&](absl::Status status) {
    std::filesystem::remove_all(folder, ignored);
    return status;
  };
  if (::mkdir(folder.c_str(), 0700) != 0) {
    return failed(
        absl::InternalError(absl::StrCat("cannot make ", folder, ": ", std::strerror(errno))));
  }
  for (auto [source, name, bytes] : {std::tuple{&sources_.key_file, "key.pem", &key},
                                     std::tuple{&sources_.cert_file, "cert.pem", &cert},
                                     std::tuple{&sources_.root_file, "roots.pem", &roots}}) {
    if (source->empty()) continue;
    if (absl::Status written = WriteNewFile(absl::StrCat(folder, "/", name), *bytes);
        !written.ok()) {
      return failed(written);
    }
  }
  // The swap: a new link renamed over "current", so a reader sees the old folder or the new one.
  const std::string link = dir_ + "/current.new";
  ::unlink(link.c_str());
  if (::symlink(version.c_str(), link.c_str()) != 0 ||
      ::rename(link.c_str(), (dir_ + "/current").c_str()) != 0) {
    return failed(absl::InternalError(
        absl::StrCat("cannot point ", dir_, "/current at ", version, ": ", std::strerror(errno))));
  }
  // The folder before the previous one: no reload still reads it.
  if (next > 2) std::filesystem::remove_all(absl::StrCat(dir_, "/v", next - 2), ignored);
  generation_ = next;
  key_ = key;
  cert_ = cert;
  roots_ = roots;
  return absl::OkStatus();
}

void TlsFileStager::Run(absl::Duration interval) {
  std::string last_refusal;
  while (true) {
    mu_.LockWhenWithTimeout(absl::Condition(&stop_), interval);
    const bool stopped = stop_;
    mu_.Unlock();
    if (stopped) return;
    const int64_t before = generation();
    const absl::Status refreshed = Refresh();
    if (!refreshed.ok()) {
      if (refreshed.ToString() != last_refusal) {
        last_refusal = refreshed.ToString();
        LogJson("warn", "TLS files not reloaded: the last good ones stay in use",
                {{"status", last_refusal}});
      }
      continue;
    }
    last_refusal.clear();
    if (generation() != before) {
      LogJson("info", "TLS files reloaded",
              {{"cert", sources_.cert_file}, {"ca", sources_.root_file}});
    }
  }
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
  absl::StatusOr<std::shared_ptr<grpc::experimental::CertificateProviderInterface>> provider =
      WatchFiles({.key_file = flags.key_file,
                  .cert_file = flags.cert_file,
                  .root_file = flags.client_ca_file,
                  .root_flag = "--tls-client-ca"},
                 flags.tls_reload_interval_s);
  if (!provider.ok()) return provider.status();
  grpc::experimental::TlsServerCredentialsOptions options(*provider);
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
  absl::StatusOr<std::shared_ptr<grpc::experimental::CertificateProviderInterface>> provider =
      WatchFiles({.key_file = flags.key_file,
                  .cert_file = flags.cert_file,
                  .root_file = flags.ca_file,
                  .root_flag = "--tls-ca"},
                 flags.tls_reload_interval_s);
  if (!provider.ok()) return provider.status();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(*provider);
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

absl::StatusOr<std::string> BearerTokenAuthenticator::ClientOf(
    absl::string_view authorization) const {
  // The scheme is case-insensitive (RFC 7235 section 2.1).
  if (!absl::StartsWithIgnoreCase(authorization, kBearerPrefix)) {
    return absl::UnauthenticatedError("the authorization header is not \"Bearer TOKEN\"");
  }
  authorization.remove_prefix(kBearerPrefix.size());
  const std::string* client = nullptr;
  for (const auto& [token, name] : clients_by_token_) {
    if (SameBytes(token, authorization) && client == nullptr)
      client = &name;  // every token compared
  }
  if (client == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  return *client;
}

namespace {

constexpr absl::string_view kMissingBearerToken =
    "missing bearer token (authorization: Bearer TOKEN)";

}  // namespace

absl::StatusOr<std::string> BearerTokenAuthenticator::ClientOf(
    const grpc::ServerContext& context) const {
  const auto header = context.client_metadata().find("authorization");
  if (header == context.client_metadata().end()) {
    return absl::UnauthenticatedError(kMissingBearerToken);
  }
  return ClientOf(absl::string_view(header->second.data(), header->second.size()));
}

grpc::Status BearerTokenAuthenticator::Process(const InputMetadata& auth_metadata,
                                               grpc::AuthContext* /*context*/,
                                               OutputMetadata* /*consumed_auth_metadata*/,
                                               OutputMetadata* /*response_metadata*/) {
  const auto header = auth_metadata.find("authorization");
  if (header == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(kMissingBearerToken));
  }
  const absl::StatusOr<std::string> client =
      ClientOf(absl::string_view(header->second.data(), header->second.size()));
  if (!client.ok()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(client.status().message()));
  }
  return grpc::Status::OK;
}

std::string CallerIdentity(const grpc::ServerContext& context,
                           const BearerTokenAuthenticator* tokens) {
  if (tokens != nullptr) {
    // Process accepted the call's token before the handler ran; an error here means a call that
    // did not pass through it (none on a server with tokens).
    absl::StatusOr<std::string> client = tokens->ClientOf(context);
    return client.ok() ? *std::move(client) : std::string();
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& name : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    return std::string(name.data(), name.size());
  }
  for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
    return std::string(name.data(), name.size());
  }
  return "";
}

std::string PeerHost(absl::string_view peer) {
  absl::string_view rest = peer;
  if (absl::ConsumePrefix(&rest, "ipv4:")) {
    const size_t colon = rest.rfind(':');
    return std::string(colon == absl::string_view::npos ? rest : rest.substr(0, colon));
  }
  if (absl::ConsumePrefix(&rest, "ipv6:")) {
    std::string host = absl::StrReplaceAll(rest, {{"%5B", "["}, {"%5D", "]"}, {"%25", "%"}});
    const size_t close = host.rfind(']');
    if (absl::StartsWith(host, "[") && close != std::string::npos) return host.substr(0, close + 1);
    return host;
  }
  return std::string(peer);
}

std::string TenantIdentity(const grpc::ServerContext& context,
                           const BearerTokenAuthenticator* tokens) {
  std::string identity = CallerIdentity(context, tokens);
  if (!identity.empty()) return identity;
  return absl::StrCat("peer:", PeerHost(context.peer()));
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

bool OwnerTable::Erase(const std::string& id) {
  absl::MutexLock lock(&mu_);
  const auto owner = owners_.find(id);
  if (owner == owners_.end() || owner->second.pending) return false;
  owners_.erase(owner);
  return true;
}

size_t OwnerTable::size() const {
  absl::MutexLock lock(&mu_);
  return owners_.size();
}

}  // namespace dsa
