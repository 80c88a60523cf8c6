// SocketListener: one listening socket of dosd and the thread that accepts on
// it. The gRPC socket (daemon/rpc/unix_listener), the descriptor socket
// (daemon/transport/fd_server) and the loopback metrics endpoint (TCP,
// daemon/metrics/metrics_http_server) are each served by one, so the accept
// loop, its wake-up and the teardown live here only.
//
// - Bind(): a unix socket. The socket file is created 0600 (umask) and only
//   then given its group and mode, so no one connects before its permissions
//   are right. BindTcp(): a TCP socket on an IPv4 or IPv6 address (mode and
//   group do not apply). Neither listens yet: a connect is refused, not
//   queued, until Serve().
// - Serve(): listen(2) and start the thread, which polls the socket and an
//   eventfd; each accepted connection goes to the handler on that thread (a
//   handler that may wait on its client hands the connection on instead).
//   Out of descriptors (EMFILE, ENFILE) or memory, the thread waits 50 ms on
//   the eventfd alone before accepting again, rather than spin.
// - Stop() / the destructor: wake the thread through the eventfd, join it
//   (a handler running finishes first; none runs after), then the destructor
//   closes the socket and removes a unix socket's file. The caller owns the
//   path (dosd holds <socket>.lock, SocketGuard), so removing it never hits
//   another daemon's socket.
//
// Thread-safety: Serve/Stop from one thread; the handler runs on the
// listener's thread ("thread_name").
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dos/wire/unique_fd.h"

namespace dos {

struct SocketListenerOptions {
  int type = SOCK_STREAM;     // or SOCK_SEQPACKET (unix sockets)
  mode_t mode = 0660;         // the socket file's mode once bound (unix sockets)
  gid_t group = static_cast<gid_t>(-1);  // the socket file's group; -1: unchanged
  int backlog = 128;
  int accept_flags = SOCK_CLOEXEC;  // accept4 flags (SOCK_NONBLOCK for gRPC)
  std::string thread_name = "dos-listen";  // at most 15 characters
  std::string flag = "--socket";  // what sets the path or address, for messages
};

class SocketListener {
 public:
  using Handler = std::function<void(UniqueFd)>;

  // INVALID_ARGUMENT for a path too long for sun_path, UNAVAILABLE when
  // binding fails (a stale file, a missing or read-only folder),
  // PERMISSION_DENIED when the group or mode cannot be set; each names the
  // path and the fix.
  static absl::StatusOr<std::unique_ptr<SocketListener>> Bind(const std::string& path,
                                                              SocketListenerOptions options);
  // A TCP socket bound to `addr` (sockaddr_in or sockaddr_in6; port 0: any
  // free port, see port()), with SO_REUSEADDR. UNAVAILABLE when binding
  // fails (the port in use, not an address of this machine), naming the
  // address and options.flag.
  static absl::StatusOr<std::unique_ptr<SocketListener>> BindTcp(const sockaddr* addr,
                                                                 socklen_t len,
                                                                 SocketListenerOptions options);
  ~SocketListener();  // Stop(), close, unlink a unix socket's path
  SocketListener(const SocketListener&) = delete;
  SocketListener& operator=(const SocketListener&) = delete;

  // Listens and hands every accepted connection to `handler`. Once only.
  absl::Status Serve(Handler handler);
  // Stops accepting; returns once the thread has exited. Idempotent.
  void Stop();

  // The unix socket's path ("" for TCP).
  const std::string& path() const { return path_; }
  // The bound TCP port (0 for a unix socket).
  uint16_t port() const;

 private:
  SocketListener(std::string path, std::string name, SocketListenerOptions options, UniqueFd fd,
                 UniqueFd wake)
      : path_(std::move(path)),
        name_(std::move(name)),
        options_(std::move(options)),
        fd_(std::move(fd)),
        wake_(std::move(wake)) {}
  // The listener of a bound `fd`, once it has its wake-up eventfd.
  static absl::StatusOr<std::unique_ptr<SocketListener>> Make(std::string path, std::string name,
                                                              SocketListenerOptions options,
                                                              UniqueFd fd);
  void Loop();
  // Waits up to `ms` for the wake eventfd; true if woken (stop).
  bool WaitForWake(int ms);

  const std::string path_;  // unix: the socket file; "" for TCP
  const std::string name_;  // for messages and logs: the path, or "tcp:ADDRESS:PORT"
  const SocketListenerOptions options_;
  UniqueFd fd_;
  UniqueFd wake_;
  Handler handler_;
  std::thread thread_;
};

}  // namespace dos
