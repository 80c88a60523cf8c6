#include "daemon/common/socket_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/fd_limits.h"
#include "daemon/common/log.h"

namespace dos {

absl::StatusOr<std::unique_ptr<SocketListener>> SocketListener::Bind(
    const std::string& path, SocketListenerOptions options) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path \"", path, "\" has ", path.size(), " bytes; a unix socket's path has 1 to ",
        sizeof(addr.sun_path) - 1, ": use a shorter ", options.flag));
  }
  UniqueFd fd(::socket(AF_UNIX, options.type | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::InternalError(absl::StrCat("socket for ", path, ": ", std::strerror(errno)));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Created without any permission for others until chown/chmod below.
  const mode_t old_umask = ::umask(0177);
  const int bound = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) {
    return absl::UnavailableError(absl::StrCat("cannot bind unix:", path, ": ",
                                               std::strerror(bind_errno),
                                               "; check that its folder exists and dosd may "
                                               "write there, or choose another ", options.flag));
  }
  auto fail = [&](absl::Status st) {
    ::unlink(path.c_str());
    return st;
  };
  if (options.group != static_cast<gid_t>(-1) &&
      ::chown(path.c_str(), static_cast<uid_t>(-1), options.group) != 0) {
    return fail(absl::PermissionDeniedError(
        absl::StrCat("cannot give ", path, " group ", options.group, ": ", std::strerror(errno),
                     "; run dosd as a member of that group (or as root)")));
  }
  if (::chmod(path.c_str(), options.mode) != 0) {
    return fail(absl::PermissionDeniedError(
        absl::StrCat("cannot set the mode of ", path, ": ", std::strerror(errno))));
  }
  absl::StatusOr<std::unique_ptr<SocketListener>> l = Make(path, path, std::move(options),
                                                           std::move(fd));
  if (!l.ok()) return fail(l.status());
  return l;
}

absl::StatusOr<std::unique_ptr<SocketListener>> SocketListener::BindTcp(
    const sockaddr* addr, socklen_t len, SocketListenerOptions options) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (addr->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (addr->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "a TCP listener takes an IPv4 or IPv6 address, not address family ", addr->sa_family));
  }
  const std::string name = absl::StrCat("tcp:", host, ":", port);
  UniqueFd fd(::socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::InternalError(absl::StrCat("socket for ", name, ": ", std::strerror(errno)));
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), addr, len) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot bind ", name, ": ", std::strerror(errno),
                                               "; choose another ", options.flag));
  }
  return Make("", name, std::move(options), std::move(fd));
}

absl::StatusOr<std::unique_ptr<SocketListener>> SocketListener::Make(std::string path,
                                                                     std::string name,
                                                                     SocketListenerOptions options,
                                                                     UniqueFd fd) {
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC));
  if (!wake.valid()) {
    return absl::InternalError(absl::StrCat("eventfd for ", name, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<SocketListener>(new SocketListener(
      std::move(path), std::move(name), std::move(options), std::move(fd), std::move(wake)));
}

uint16_t SocketListener::port() const {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (!path_.empty() || ::getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return 0;
  }
  if (bound.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (bound.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return 0;
}

SocketListener::~SocketListener() {
  Stop();
  fd_.reset();
  if (!path_.empty()) ::unlink(path_.c_str());
}

absl::Status SocketListener::Serve(Handler handler) {
  if (thread_.joinable() || handler_) {
    return absl::FailedPreconditionError(absl::StrCat(name_, " is already served"));
  }
  if (::listen(fd_.get(), options_.backlog) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", name_, ": ", std::strerror(errno)));
  }
  handler_ = std::move(handler);
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), options_.thread_name.c_str());
    Loop();
  });
  return absl::OkStatus();
}

void SocketListener::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

bool SocketListener::WaitForWake(int ms) {
  pollfd p{wake_.get(), POLLIN, 0};
  return ::poll(&p, 1, ms) > 0;
}

void SocketListener::Loop() {
  while (true) {
    pollfd fds[2] = {{fd_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      DOS_LOG_ERROR("listen.poll_failed", "socket", name_, "error", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    UniqueFd conn(::accept4(fd_.get(), nullptr, nullptr, options_.accept_flags));
    if (!conn.valid()) {
      const int err = errno;
      if (err == EAGAIN || err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE) {
        LogOutOfDescriptors(absl::StrCat("accept ", name_), err);
      } else {
        DOS_LOG_WARNING("listen.accept_failed", "socket", name_, "error", std::strerror(err));
      }
      // Out of descriptors or memory: the pending connection stays queued
      // and poll would answer at once; give the process a moment.
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        if (WaitForWake(50)) return;
      }
      continue;
    }
    handler_(std::move(conn));
  }
}

}  // namespace dos
