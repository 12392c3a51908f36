// Transport security of every gRPC hop (docs/deploy.md "TLS, mutual TLS and bearer
// tokens"): TLS and mutual TLS from PEM files, bearer tokens for the router-facing API (gRPC's
// AuthMetadataProcessor), the caller identity a server sees, and which caller owns a sequence.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace dsa {

/// PEM files of one process's TLS identity and trust. All empty = plaintext (today's default).
struct TlsFlags {
  std::string cert_file;       // --tls-cert: certificate chain, served and shown when dialing
  std::string key_file;        // --tls-key: its private key
  std::string client_ca_file;  // --tls-client-ca: the server requires client certificates (mTLS)
  std::string ca_file;         // --tls-ca: CA bundle of the servers this process dials
  std::string server_name;     // --tls-server-name: name checked in dialed servers' certificates
  /// --tls-reload-interval-s: how often the files are read again (seconds, >= 1), so that a
  /// renewed certificate (cert-manager rewriting the mounted Secret) is served and shown on new
  /// connections without a restart.
  int tls_reload_interval_s = 60;
};

/// Registers --tls-cert, --tls-key, --tls-client-ca, --tls-ca and --tls-server-name on `app`
/// (files must exist). `serves` = false (a client such as the dsa tool) leaves out
/// --tls-client-ca.
void AddTlsFlags(CLI::App& app, TlsFlags& flags, bool serves);

/// Checked copies of a process's TLS files, which gRPC's file watcher
/// (FileWatcherCertificateProvider) reads in their place. The watcher takes whatever a reload
/// reads: a certificate file read in the middle of a rewrite (empty) makes gRPC 1.51 abort the
/// process, and a wrong certificate or key makes every handshake fail. The stager reads the files
/// itself and checks them: the certificate file holds a PEM certificate, the key file the private
/// key of that certificate, the CA bundle at least one PEM certificate. Only then are they
/// copied, into a new version folder of a private folder (mode 0700; where: Start), and the link
/// "current" that gRPC reads through is renamed over to it (as the kubelet swaps a Secret's
/// folder). Files that fail the check are not copied: the last good ones stay in use.
/// Thread-safe.
class TlsFileStager {
 public:
  /// PEM files, each "" for none; a key goes with a certificate.
  struct Files {
    std::string key_file;
    std::string cert_file;
    std::string root_file;
    /// The flag that names root_file, for messages ("--tls-client-ca" or "--tls-ca").
    std::string root_flag = "--tls-ca";
  };

  /// Checks and stages `sources` in a new private folder under /dev/shm (memory: the copies hold
  /// the private key), else $TMPDIR, else /tmp. With `interval` > 0 a thread refreshes every
  /// `interval` (logging a refused reload once per change of its reason, "warn", and a staged
  /// one, "info") until destruction. Errors: INVALID_ARGUMENT for a file that holds no PEM
  /// certificate (key), a certificate block that does not parse, a key that is not the
  /// certificate's, a key without a certificate; NOT_FOUND / PERMISSION_DENIED /
  /// FAILED_PRECONDITION for a file that cannot be read (each naming the flag and path);
  /// INTERNAL when no folder can be made or written (the files themselves passed).
  static absl::StatusOr<std::unique_ptr<TlsFileStager>> Start(const Files& sources,
                                                              absl::Duration interval);
  /// Stops the thread and removes the private folder.
  ~TlsFileStager() ABSL_LOCKS_EXCLUDED(mu_);
  TlsFileStager(const TlsFileStager&) = delete;
  TlsFileStager& operator=(const TlsFileStager&) = delete;

  /// The paths gRPC reads (through the "current" link); "" where the source is "". root_flag
  /// as given.
  const Files& staged() const { return staged_; }
  /// The private folder (removed with this object).
  const std::string& folder() const { return dir_; }

  /// Reads the sources again: OK when they are unchanged or were staged anew; Start's errors when
  /// they fail the check (nothing is copied and the last good files stay).
  absl::Status Refresh() ABSL_LOCKS_EXCLUDED(mu_, refresh_mu_);

  /// Ends the refreshes (Refresh answers CANCELLED from then on), removes the private folder and
  /// joins the thread. Idempotent. For the process's exit, when gRPC no longer reads the files.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  /// How many times files were staged: 1 after Start, one more per change staged.
  int64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TlsFileStager(Files sources, std::string dir);
  absl::Status StageLocked(const std::string& key, const std::string& cert,
                           const std::string& roots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(absl::Duration interval) ABSL_LOCKS_EXCLUDED(mu_);

  const Files sources_;
  const std::string dir_;
  Files staged_;
  absl::Mutex refresh_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // held through a whole Refresh
  mutable absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string key_ ABSL_GUARDED_BY(mu_);  // the staged bytes
  std::string cert_ ABSL_GUARDED_BY(mu_);
  std::string roots_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

/// The credentials of a server's gRPC port: insecure when `flags` names no certificate; TLS with
/// cert_file and key_file; and, with client_ca_file, client certificates required and verified
/// against it (mutual TLS). The files are read again every tls_reload_interval_s and checked
/// (TlsFileStager, which the process keeps until it exits): new handshakes use what they held at
/// the last read that passed; a file that became unreadable, empty or wrong (a certificate
/// without its key yet) leaves the last good ones in use. Errors: INVALID_ARGUMENT for a
/// certificate without its key (or the reverse), a client CA without a certificate, a reload
/// interval below 1, a file that holds no PEM certificate (key), a key that is not the
/// certificate's; NOT_FOUND / PERMISSION_DENIED / FAILED_PRECONDITION for a file that cannot be
/// read now (naming the flag and path). Where no folder can be had for the checked copies (a
/// read-only file system without /dev/shm or /tmp), the files are watched directly, checked at
/// start only, with a warning.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(
    const TlsFlags& flags);

/// How a process dials: channel credentials plus the target-name override. The default value
/// is plaintext. Copyable; one value serves every channel of the process.
struct ClientSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null = insecure
  std::string server_name;                                // "" = the address's host
  bool tls() const { return credentials != nullptr; }
};

/// The client side of `flags`: TLS verified against ca_file when it is set (the server's
/// certificate must chain to it and hold the dialed name, or server_name), and the process's
/// cert_file/key_file presented as its client certificate when both are set; the files are read
/// again and checked every tls_reload_interval_s, as the server's are (ServerCredentialsFrom);
/// with `bearer_token`, every call also carries "authorization: Bearer <token>" (gRPC's
/// AccessTokenCredentials). Errors: INVALID_ARGUMENT for a token or a client certificate
/// without ca_file (a token never crosses plaintext), half a certificate pair, a file that holds
/// no PEM certificate (key), a key that is not the certificate's; NOT_FOUND / PERMISSION_DENIED /
/// FAILED_PRECONDITION for a file that cannot be read.
absl::StatusOr<ClientSecurity> ClientSecurityFrom(const TlsFlags& flags,
                                                  const std::string& bearer_token = "");

/// A channel to `address` with `security` (and its target-name override added to `arguments`).
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          const ClientSecurity& security,
                                          grpc::ChannelArguments arguments = {});

/// The contents of `path`, with its trailing whitespace removed (a token file). Errors as
/// ServerCredentialsFrom's, and INVALID_ARGUMENT for an empty file.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

/// Bearer tokens of the router-facing API: every call must carry "authorization: Bearer T" with
/// T one of the tokens. A call without one is refused with UNAUTHENTICATED "missing bearer
/// token"; a wrong one with UNAUTHENTICATED "unknown bearer token". Tokens are compared in
/// constant time. gRPC calls Process only on a secure port: RunServer refuses tokens without TLS.
/// Process leaves the auth context alone and the header in the call's metadata: gRPC's auth
/// context belongs to the connection, not the call, so a property added there would name every
/// later call on the connection by the first one's client (calls of several tokens share a
/// router's connection), grow with every call, and be reallocated under concurrent readers. A
/// handler names the call's client with ClientOf (CallerIdentity and TenantIdentity do).
class BearerTokenAuthenticator final : public grpc::AuthMetadataProcessor {
 public:
  /// Parses `text`: one "CLIENT TOKEN" per line (blank lines and "#" comments skipped).
  /// INVALID_ARGUMENT (naming the line) for a line without both fields, a repeated token or
  /// client, or no token at all.
  static absl::StatusOr<std::shared_ptr<BearerTokenAuthenticator>> Parse(absl::string_view text);
  /// Parse of the file at `path` (errors prefixed with the path).
  static absl::StatusOr<std::shared_ptr<BearerTokenAuthenticator>> Load(const std::string& path);

  bool IsBlocking() const override { return false; }  // a map lookup: run inline
  /// OK when the call's metadata has an "authorization" header that ClientOf accepts; its error
  /// otherwise. Touches neither `context` nor the metadata.
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;
  /// The client whose token an "authorization" header value carries ("Bearer T", the scheme's
  /// case free); UNAUTHENTICATED "the authorization header is not \"Bearer TOKEN\"" or "unknown
  /// bearer token". Every token is compared, in constant time.
  absl::StatusOr<std::string> ClientOf(absl::string_view authorization) const;
  /// ClientOf the call's "authorization" header; UNAUTHENTICATED "missing bearer token ..."
  /// without one.
  absl::StatusOr<std::string> ClientOf(const grpc::ServerContext& context) const;
  size_t size() const { return clients_by_token_.size(); }

 private:
  explicit BearerTokenAuthenticator(std::vector<std::pair<std::string, std::string>> tokens);
  std::vector<std::pair<std::string, std::string>> clients_by_token_;  // (token, client)
};

/// Who is calling, as a server sees it: with `tokens`, the client of the call's bearer token
/// (BearerTokenAuthenticator::ClientOf); else the common name of a verified client certificate
/// (mutual TLS), else "" (anonymous: plaintext or TLS without client certificates).
std::string CallerIdentity(const grpc::ServerContext& context,
                           const BearerTokenAuthenticator* tokens = nullptr);

/// The host of a gRPC peer string (ServerContext::peer()) without its port: "ipv4:1.2.3.4:5" ->
/// "1.2.3.4", "ipv6:[::1]:5" (or its URI-escaped form "ipv6:%5B::1%5D:5") -> "[::1]"; a peer
/// of another form (e.g. "unix:/path", "unix-abstract:name") is returned whole, and "" for "".
std::string PeerHost(absl::string_view peer);

/// The tenant a request belongs to, for what callers must not share (sessions, prefix donors,
/// request ids) and for per-caller fairness: CallerIdentity (with `tokens`, the server's bearer
/// tokens when it has them) when it is not empty, else
/// "peer:" + PeerHost(context.peer()), so that on plaintext (or TLS without client
/// certificates) each client host is its own tenant, and a client's reconnections (a new port
/// each) stay one. Clients behind one address (a proxy, a NAT, processes on one host) share one
/// tenant; give them tokens to tell them apart. A token or certificate name that itself starts
/// with "peer:" would stand for that host: do not issue such names.
std::string TenantIdentity(const grpc::ServerContext& context,
                           const BearerTokenAuthenticator* tokens = nullptr);

/// Which caller owns each sequence (or request) of a server (docs/reliability.md, "Sequences belong
/// to the caller that created them"). Ids are claimed when created and forgotten when released;
/// thread-safe. Anonymous callers ("") share one identity, so a plaintext deployment behaves as
/// before.
class OwnerTable {
 public:
  /// A caller's hold on an id while it creates what the id names. Move-only. A new claim (the id
  /// had no owner) is forgotten when the claim is destroyed unless Keep() was called, so a failed
  /// create leaves no owner behind; while it is held, a second create of the id is refused and a
  /// release cannot erase it, so a duplicate create that succeeds can never leave the id unowned.
  class Claim {
   public:
    Claim() = default;
    Claim(Claim&& other) noexcept;
    Claim& operator=(Claim&& other) noexcept;
    Claim(const Claim&) = delete;
    Claim& operator=(const Claim&) = delete;
    ~Claim();
    /// The create succeeded: the id stays the caller's until released.
    void Keep();
    /// Whether this claim recorded the owner (false: the id was already the caller's, or the
    /// caller is an operator; then Keep and the destructor change nothing).
    bool is_new() const { return table_ != nullptr; }

   private:
    friend class OwnerTable;
    Claim(OwnerTable* table, std::string id) : table_(table), id_(std::move(id)) {}
    void Drop();
    OwnerTable* table_ = nullptr;  // set while a new claim is pending
    std::string id_;
  };

  /// `operators`: identities that may act on any id (the coordinator, which releases the
  /// indexer sequences of a dead attention worker).
  explicit OwnerTable(std::vector<std::string> operators = {});
  /// Claims `id` for `caller`: a new claim when it has no owner (recorded at once, pending until
  /// Keep); a claim that is not new when `id` is already `caller`'s or `caller` is an operator.
  /// Errors: PERMISSION_DENIED as Check when `id` belongs to another caller; ALREADY_EXISTS
  /// "<what> <id> is being created by another call" while another claim of it is pending.
  absl::StatusOr<Claim> Acquire(const std::string& id, const std::string& caller,
                                absl::string_view what);
  /// OK when `id` has no recorded owner, is `caller`'s, or `caller` is an operator; else
  /// PERMISSION_DENIED "<what> <id> belongs to another caller".
  absl::Status Check(const std::string& id, const std::string& caller,
                     absl::string_view what) const;
  /// Erases `id`'s owner if it is `caller` (or `caller` is an operator) and no claim of it is
  /// pending, so that a Release racing a create can never erase that create's claim. Returns
  /// whether it erased.
  bool Forget(const std::string& id, const std::string& caller);
  /// Erases `id`'s owner whoever it is, unless a claim of it is pending (the worker released it
  /// on its own: its lease ended). Returns whether it erased.
  bool Erase(const std::string& id);
  size_t size() const;

 private:
  struct Owner {
    std::string caller;
    bool pending = false;  // a Claim is creating what the id names
  };
  bool IsOperator(const std::string& caller) const;
  const std::vector<std::string> operators_;
  mutable absl::Mutex mu_;
  std::map<std::string, Owner> owners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dsa
