#include "daemon/transport/peer_process.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5; Debian 12's headers predate it
#endif

namespace dos {
namespace {
// glibc 2.36's <sys/pidfd.h> lacks extern "C"; the system call is plain.
int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
}  // namespace

absl::StatusOr<std::shared_ptr<const PeerProcess>> PeerProcess::FromSocket(int sock) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read the peer's credentials (SO_PEERCRED): ", std::strerror(errno)));
  }
  if (cred.pid <= 0) {
    return absl::PermissionDeniedError(
        "the peer's process is not visible from dosd's pid namespace; run dosd in the "
        "trainers' pid namespace or a parent of it");
  }
  // Supplementary groups as of connect() (NGROUPS_MAX is 65536: ask for the size).
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int grc = ::getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (grc != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(gid_t));
    grc = ::getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  if (grc != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot read the peer's groups (SO_PEERGROUPS): ", std::strerror(errno)));
  }
  groups.resize(glen / sizeof(gid_t));
  int pidfd = -1;
  len = sizeof pidfd;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0) {
    pidfd = PidfdOpen(cred.pid);  // before 6.5: the pid as of now
  }
  if (pidfd < 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot open a pidfd of peer pid ", cred.pid,
                                                    ": ", std::strerror(errno),
                                                    "; the process exited while attaching"));
  }
  return std::shared_ptr<const PeerProcess>(
      new PeerProcess(cred.pid, cred.uid, cred.gid, std::move(groups), UniqueFd(pidfd)));
}

absl::StatusOr<std::shared_ptr<const PeerProcess>> PeerProcess::FromPid(pid_t pid) {
  int pidfd = PidfdOpen(pid);
  if (pidfd < 0) {
    return absl::NotFoundError(absl::StrCat("pidfd_open(", pid, "): ", std::strerror(errno)));
  }
  return std::shared_ptr<const PeerProcess>(
      new PeerProcess(pid, static_cast<uid_t>(-1), static_cast<gid_t>(-1), {}, UniqueFd(pidfd)));
}

bool PeerProcess::Alive() const {
  pollfd p{pidfd_.get(), POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r == 0;  // readable (or an error): the process exited
}

}  // namespace dos
