// UnixListener: dosd's gRPC unix socket, accepted by dosd itself so that
// every connection's kernel credentials are known (see caller_identity.h).
// Each accepted connection's SO_PEERCRED/SO_PEERGROUPS go into the PeerTable
// and the descriptor to the gRPC server (AddInsecureChannelFromFd). The
// accept loop is a SocketListener (daemon/common/socket_listener.h).
//
// Each connection costs dosd a descriptor, so one uid holds at most twice its
// session cap (--max_sessions_per_uid; a trainer's session has one) plus 16
// (dosctl, probes) at once; 0: no bound. Beyond, a new one is closed at once
// and auth.connection_refused logged (rate-limited), so one user's idle
// connections cannot take the descriptors another user's attach needs.
//
// Thread-safety: Serve/Stop from one thread; one thread ("dos-accept")
// accepts.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/socket_listener.h"
#include "daemon/rpc/caller_identity.h"

namespace grpc {
class Server;
}

namespace dos {

class UnixListener {
 public:
  // Binds `path` (which must not exist: SocketGuard removed a stale one),
  // sets `mode` and `group` (-1: unchanged) on it. It listens and accepts
  // once Serve() is called.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(
      const std::string& path, mode_t mode, gid_t group, PeerTable* peers,
      uint32_t max_sessions_per_uid = 0);
  ~UnixListener() = default;  // stops accepting, removes the socket file

  // Listens and starts the accept thread; `server` must outlive Stop().
  absl::Status Serve(grpc::Server* server);
  // Stops accepting (connections already handed to gRPC stay).
  void Stop() { listener_->Stop(); }

 private:
  UnixListener(std::unique_ptr<SocketListener> listener, PeerTable* peers, uint32_t max_per_uid)
      : listener_(std::move(listener)), peers_(peers), max_per_uid_(max_per_uid) {}
  void Accepted(UniqueFd fd, grpc::Server* server);

  const std::unique_ptr<SocketListener> listener_;
  PeerTable* const peers_;
  const uint32_t max_per_uid_;
};

}  // namespace dos
