#include "daemon/rpc/unix_listener.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"

namespace dos {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path,
                                                                  mode_t mode, gid_t group,
                                                                  PeerTable* peers) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--socket \"", path, "\" is too long"));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  // Created without any permission for others until chmod/chown below.
  const mode_t old = ::umask(0177);
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  const int err = errno;
  ::umask(old);
  if (rc != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot bind unix:", path, ": ",
                                               std::strerror(err),
                                               "; check the directory's permissions"));
  }
  if (group != static_cast<gid_t>(-1) && ::chown(path.c_str(), static_cast<uid_t>(-1), group) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat("cannot give ", path, " group ", group, ": ",
                                                    std::strerror(e),
                                                    "; run dosd as a member of that group"));
  }
  if (::chmod(path.c_str(), mode) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot chmod ", path, ": ", std::strerror(e)));
  }
  int wake = ::eventfd(0, EFD_CLOEXEC);
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd, wake, peers));
}

UnixListener::~UnixListener() {
  Stop();
  ::close(fd_);
  ::close(wake_);
}

void UnixListener::Serve(grpc::Server* server) {
  // Listening only now: until then a connect is refused, not queued, so an
  // accepting socket means a serving daemon.
  if (::listen(fd_, 4096) != 0) {
    DOS_LOG_ERROR("rpc.listen_failed", "socket", path_, "error", std::strerror(errno));
    return;
  }
  thread_ = std::thread([this, server] {
    pthread_setname_np(pthread_self(), "dos-accept");
    Loop(server);
  });
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
  thread_.join();
}

void UnixListener::Loop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      DOS_LOG_ERROR("rpc.accept_failed", "error", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        DOS_LOG_WARNING("rpc.accept_failed", "error", std::strerror(errno));
      }
      continue;
    }
    CallerIdentity id;
    ucred cred{};
    socklen_t len = sizeof cred;
    struct stat st;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || ::fstat(fd, &st) != 0) {
      ::close(fd);
      continue;
    }
    id.known = true;
    id.pid = cred.pid;
    id.uid = cred.uid;
    id.gid = cred.gid;
    gid_t groups[256];
    socklen_t glen = sizeof groups;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &glen) == 0) {
      id.groups.assign(groups, groups + glen / sizeof(gid_t));
    }
    peers_->Record(fd, st.st_ino, std::move(id));
    grpc::AddInsecureChannelFromFd(server, fd);  // gRPC owns fd from here
  }
}

}  // namespace dos
