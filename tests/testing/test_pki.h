// A throwaway PKI for the TLS tests, made with the openssl command line (bootstrap installs it)
// in a fresh temporary folder: a CA, a second unrelated CA, and leaf certificates (EC P-256,
// valid two days, SAN localhost and 127.0.0.1, usable as server and client certificates) with a
// given common name, which is the identity the servers see (server/security.h CallerIdentity).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace dsa::testing {

/// PEM file paths of one certificate and its key.
struct TestIdentity {
  std::string cert;
  std::string key;
};

class TestPki {
 public:
  /// Makes both CAs under a new folder in the system's temporary directory. ok() says whether
  /// every openssl command succeeded.
  TestPki() {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("dsa-pki-", ::getpid(), "-", reinterpret_cast<uintptr_t>(this));
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "leaf.ext") << "basicConstraints=CA:FALSE\n"
                                        "keyUsage=digitalSignature,keyEncipherment\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n"
                                        "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
    ok_ = MakeCa("ca") && MakeCa("wrong-ca");
  }
  ~TestPki() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  bool ok() const { return ok_; }
  std::string ca() const { return (dir_ / "ca.crt").string(); }
  std::string wrong_ca() const { return (dir_ / "wrong-ca.crt").string(); }
  std::string dir() const { return dir_.string(); }

  /// A certificate with common name `name` signed by the CA (or, with `by_wrong_ca`, the other
  /// one). Empty paths when openssl failed.
  TestIdentity Issue(const std::string& name, bool by_wrong_ca = false) {
    const std::string ca = by_wrong_ca ? "wrong-ca" : "ca";
    const std::string base = (dir_ / absl::StrCat(name, by_wrong_ca ? "-wrong" : "")).string();
    const bool made =
        Run(absl::StrCat("openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes",
                         " -keyout ", base, ".key -out ", base, ".csr -subj /CN=", name)) &&
        Run(absl::StrCat("openssl x509 -req -in ", base, ".csr -CA ", (dir_ / ca).string(),
                         ".crt -CAkey ", (dir_ / ca).string(), ".key -CAcreateserial -days 2",
                         " -extfile ", (dir_ / "leaf.ext").string(), " -out ", base, ".crt"));
    if (!made) return {};
    return {base + ".crt", base + ".key"};
  }

  /// Writes `text` to a file of the folder; its path.
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

 private:
  static bool Run(const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
  }
  bool MakeCa(const std::string& name) {
    const std::string base = (dir_ / name).string();
    return Run(absl::StrCat(
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2",
        " -keyout ", base, ".key -out ", base, ".crt -subj /CN=dsa-test-", name,
        " -addext basicConstraints=critical,CA:TRUE -addext "
        "keyUsage=critical,keyCertSign,cRLSign"));
  }

  std::filesystem::path dir_;
  bool ok_ = false;
};

}  // namespace dsa::testing
