// UnixListener: dosd's gRPC unix socket, accepted by dosd itself so that
// every connection's kernel credentials are known (see caller_identity.h).
// Each accepted connection's SO_PEERCRED/SO_PEERGROUPS go into the PeerTable
// and the descriptor to the gRPC server (AddInsecureChannelFromFd). The
// accept loop is a SocketListener (daemon/common/socket_listener.h).
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
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path, mode_t mode,
                                                            gid_t group, PeerTable* peers);
  ~UnixListener() = default;  // stops accepting, removes the socket file

  // Listens and starts the accept thread; `server` must outlive Stop().
  absl::Status Serve(grpc::Server* server);
  // Stops accepting (connections already handed to gRPC stay).
  void Stop() { listener_->Stop(); }

 private:
  UnixListener(std::unique_ptr<SocketListener> listener, PeerTable* peers)
      : listener_(std::move(listener)), peers_(peers) {}
  void Accepted(UniqueFd fd, grpc::Server* server);

  const std::unique_ptr<SocketListener> listener_;
  PeerTable* const peers_;
};

}  // namespace dos
