// UnixListener: dosd's unix socket, accepted by dosd itself so that every
// connection's kernel credentials are known (see caller_identity.h). Each
// accepted connection's SO_PEERCRED/SO_PEERGROUPS go into the PeerTable and
// the descriptor to the gRPC server (AddInsecureChannelFromFd).
//
// Thread-safety: Start/Stop from one thread; one thread ("dos-accept")
// accepts.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
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
  ~UnixListener();  // Stop()s

  // Starts the accept thread; `server` must outlive Stop().
  void Serve(grpc::Server* server);
  // Stops accepting (connections already handed to gRPC stay).
  void Stop();

 private:
  UnixListener(std::string path, int fd, int wake, PeerTable* peers)
      : path_(std::move(path)), fd_(fd), wake_(wake), peers_(peers) {}
  void Loop(grpc::Server* server);

  const std::string path_;
  const int fd_;
  const int wake_;
  PeerTable* const peers_;
  std::thread thread_;
};

}  // namespace dos
