// MetricsHttpServer: a minimal HTTP/1.1 server for Prometheus scrapes. It
// answers GET /metrics with the page its render callback returns (usually
// MetricsRegistry::RenderText) and 404 / 405 / 400 otherwise, one request per
// connection (Connection: close). No keep-alive, requests capped at 8 KiB and
// a 2 s read deadline per connection.
//
// Two threads: a SocketListener (daemon/common, the accept loop dosd's unix
// sockets use too; "dos-metrics-acc") accepts and hands each connection to
// "dos-metrics", which polls up to 64 of them at once, each with its own
// buffer and deadline, so an idle or slow client never delays another
// client's scrape. While 64 are open, a new connection closes the oldest one
// (an idle one first: nothing received), so idle connections cannot hold a
// scrape up either.
//
// It binds loopback addresses only (127.0.0.0/8, ::1, "localhost") unless
// `allow_non_loopback` is set: the metrics reveal what runs on the node, and
// the daemon has no TCP listener the operator did not ask for.
//
// Ownership: owns its listener, connections and threads; the destructor
// stops and joins both threads. Thread-safety: `render` is called on the
// "dos-metrics" thread only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/common/socket_listener.h"
#include "dos/wire/unique_fd.h"

namespace dos {

struct MetricsHttpOptions {
  std::string host = "127.0.0.1";  // an IP literal or "localhost"; no DNS
  uint16_t port = 0;               // 0: any free port (see port())
  bool allow_non_loopback = false;
  absl::Duration read_timeout = absl::Seconds(2);
};

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;

  // Binds, listens and starts the threads. INVALID_ARGUMENT for a host that is
  // not an IP literal, PERMISSION_DENIED for a non-loopback host without
  // allow_non_loopback, UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options, Render render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  uint16_t port() const { return port_; }
  // Requests answered so far (any status).
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }

 private:
  MetricsHttpServer(std::unique_ptr<SocketListener> listener, UniqueFd wake,
                    absl::Duration read_timeout, Render render);
  static constexpr size_t kMaxConnections = 64;
  // On the listener's thread: queues `conn` for Loop, first waiting while
  // kMaxConnections are open.
  void Accepted(UniqueFd conn);
  bool RoomOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || open_ < kMaxConnections;
  }
  // "dos-metrics": reads each connection's request, answers, closes.
  void Loop();
  // Answers one complete request (or refuses a bad one) on `fd`.
  void Answer(int fd, const std::string& request);

  const std::unique_ptr<SocketListener> listener_;
  const UniqueFd wake_;  // eventfd: a connection queued, or stopping
  const uint16_t port_;
  const absl::Duration read_timeout_;
  const Render render_;
  std::atomic<uint64_t> requests_{0};
  absl::Mutex mu_;
  std::vector<UniqueFd> queued_ ABSL_GUARDED_BY(mu_);  // accepted, not yet polled
  size_t open_ ABSL_GUARDED_BY(mu_) = 0;               // queued or polled
  size_t evict_ ABSL_GUARDED_BY(mu_) = 0;  // connections to close to make room
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// True for 127.0.0.0/8 and ::1 (and their textual forms), and "localhost".
bool IsLoopbackHost(const std::string& host);

}  // namespace dos
