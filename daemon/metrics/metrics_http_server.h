// MetricsHttpServer: a minimal HTTP/1.1 server for Prometheus scrapes. It
// answers GET /metrics with the page its render callback returns (usually
// MetricsRegistry::RenderText) and 404 / 405 / 400 otherwise, one request per
// connection (Connection: close). Plain sockets, one thread ("dos-metrics")
// polling up to 64 connections at once (each with its own buffer), no
// keep-alive, requests capped at 8 KiB and a 2 s read deadline per
// connection: idle or slow clients never delay another client's scrape.
//
// It binds loopback addresses only (127.0.0.0/8, ::1, "localhost") unless
// `allow_non_loopback` is set: the metrics reveal what runs on the node, and
// the daemon has no TCP listener the operator did not ask for.
//
// Ownership: owns its socket and thread; the destructor stops and joins.
// Thread-safety: `render` is called on the server thread only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

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

  // Binds, listens and starts the thread. INVALID_ARGUMENT for a host that is
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
  MetricsHttpServer(int listen_fd, int wake_fd, uint16_t port, absl::Duration read_timeout,
                    Render render);
  static constexpr size_t kMaxConnections = 64;
  void Loop();
  // Answers one complete request (or refuses a bad one) on `fd`.
  void Answer(int fd, const std::string& request);

  const int listen_fd_;
  const int wake_fd_;  // eventfd: written by the destructor to stop the loop
  const uint16_t port_;
  const absl::Duration read_timeout_;
  const Render render_;
  std::atomic<uint64_t> requests_{0};
  std::thread thread_;
};

// True for 127.0.0.0/8 and ::1 (and their textual forms), and "localhost".
bool IsLoopbackHost(const std::string& host);

}  // namespace dos
