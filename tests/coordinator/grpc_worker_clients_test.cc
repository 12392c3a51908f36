// Tests of the gRPC worker clients (coordinator/grpc_worker_clients.cc) against a loopback port
// where nothing listens: a call fails UNAVAILABLE at once, and one made with wait_for_ready waits
// for a connection until its deadline instead (what a worker check's second try relies on).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/worker_clients.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

// A loopback TCP port bound but not listening while this lives: connects to it are refused, and
// no other process can take it meanwhile.
class RefusingPort {
 public:
  RefusingPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~RefusingPort() {
    if (fd_ >= 0) close(fd_);
  }
  RefusingPort(const RefusingPort&) = delete;
  RefusingPort& operator=(const RefusingPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

// What `ask` (a GetInfo or GetLoad of a worker at an address where nothing listens) answers
// without wait_for_ready, and with it under a 300 ms deadline.
template <typename Ask>
void ExpectWaitsOnlyWithWaitForReady(Ask ask) {
  // A deadline far beyond the test: without wait_for_ready the refusal ends the call at once.
  EXPECT_EQ(ask(WorkerCall{absl::Seconds(60), "", {}}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ask(WorkerCall{absl::Milliseconds(300), "", {}, /*wait_for_ready=*/true}).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(GrpcWorkerClientsTest, ACallWaitsForAConnectionOnlyWithWaitForReady) {
  RefusingPort refusing;
  ASSERT_GT(refusing.port(), 0);
  const std::string address = absl::StrCat("127.0.0.1:", refusing.port());
  std::shared_ptr<WorkerClientFactory> clients =
      GrpcWorkerClients(ClientSecurity{}, /*max_reconnect_backoff_ms=*/2000);
  std::shared_ptr<IndexerWorkerClient> indexer = clients->Indexer(address);
  dsa::indexer::v1::GetLoadResponse load;
  ExpectWaitsOnlyWithWaitForReady(
      [&](const WorkerCall& call) { return indexer->GetLoad(call, &load); });
  std::shared_ptr<AttentionWorkerClient> attention = clients->Attention(address);
  dsa::attention::v1::GetInfoResponse info;
  ExpectWaitsOnlyWithWaitForReady(
      [&](const WorkerCall& call) { return attention->GetInfo(call, &info); });
}

}  // namespace
}  // namespace dsa
