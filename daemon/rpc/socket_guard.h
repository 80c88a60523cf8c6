// SocketGuard: claims a unix socket path for one daemon.
//
// A lock file beside the socket (<path>.lock, flock(2)) says whether a live
// daemon owns the path: if another process holds the lock, Claim fails with
// ALREADY_EXISTS naming that daemon's pid; otherwise the lock is taken and a
// stale socket file left by a crashed daemon is removed. The kernel drops
// the lock when the process dies, so a SIGKILLed daemon never blocks its
// successor. The destructor removes the socket and the lock file (unlinked
// while still locked: Claim re-checks that the file it locked is still the
// one at the path) and releases the lock, so a clean stop leaves neither.
//
// Thread-safety: not thread-safe; owned by main().
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace dos {

class SocketGuard {
 public:
  // Creates the parent directory if missing (mode 0755).
  static absl::StatusOr<std::unique_ptr<SocketGuard>> Claim(const std::string& socket_path);
  ~SocketGuard();
  SocketGuard(const SocketGuard&) = delete;
  SocketGuard& operator=(const SocketGuard&) = delete;

  const std::string& socket_path() const { return socket_path_; }

 private:
  SocketGuard(std::string socket_path, int lock_fd)
      : socket_path_(std::move(socket_path)), lock_fd_(lock_fd) {}
  std::string socket_path_;
  int lock_fd_;
};

}  // namespace dos
