#include "daemon/rpc/unix_listener.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>

#include "daemon/common/log.h"

namespace dos {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(
    const std::string& path, mode_t mode, gid_t group, PeerTable* peers,
    uint32_t max_sessions_per_uid) {
  SocketListenerOptions o;
  o.type = SOCK_STREAM;
  o.mode = mode;
  o.group = group;
  o.backlog = 4096;
  o.accept_flags = SOCK_CLOEXEC | SOCK_NONBLOCK;  // gRPC's event loop expects it
  o.thread_name = "dos-accept";
  o.flag = "--socket";
  absl::StatusOr<std::unique_ptr<SocketListener>> l = SocketListener::Bind(path, std::move(o));
  if (!l.ok()) return l.status();
  return std::unique_ptr<UnixListener>(
      new UnixListener(*std::move(l), peers,
                       max_sessions_per_uid == 0 ? 0 : 2 * max_sessions_per_uid + 16));
}

absl::Status UnixListener::Serve(grpc::Server* server) {
  // Listening only now: until then a connect is refused, not queued, so an
  // accepting socket means a serving daemon.
  return listener_->Serve([this, server](UniqueFd fd) { Accepted(std::move(fd), server); });
}

void UnixListener::Accepted(UniqueFd fd, grpc::Server* server) {
  CallerIdentity id;
  ucred cred{};
  socklen_t len = sizeof cred;
  struct stat st;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      ::fstat(fd.get(), &st) != 0) {
    return;  // closed: a connection without credentials is not served
  }
  id.known = true;
  id.pid = cred.pid;
  id.uid = cred.uid;
  id.gid = cred.gid;
  gid_t groups[256];
  socklen_t glen = sizeof groups;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERGROUPS, groups, &glen) == 0) {
    id.groups.assign(groups, groups + glen / sizeof(gid_t));
  }
  if (max_per_uid_ != 0) {
    if (const size_t held = peers_->Connections(id.uid); held >= max_per_uid_) {
      DOS_LOG_WARNING("auth.connection_refused", "uid", id.uid, "pid", id.pid, "connections",
                      held, "limit", max_per_uid_, "fix",
                      "close connections (each session holds one) or ask the operator to raise "
                      "--max_sessions_per_uid (a uid may hold twice that, plus 16)");
      return;  // closed
    }
  }
  peers_->Record(fd.get(), st.st_ino, std::move(id));
  grpc::AddInsecureChannelFromFd(server, fd.release());  // gRPC owns it from here
}

}  // namespace dos
