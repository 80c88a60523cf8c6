#include "daemon/rpc/socket_guard.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace dos {

absl::StatusOr<std::unique_ptr<SocketGuard>> SocketGuard::Claim(const std::string& socket_path) {
  if (socket_path.empty() || socket_path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket \"", socket_path, "\" must be a path of 1 to ",
        sizeof(sockaddr_un::sun_path) - 1, " characters (a unix socket limit)"));
  }
  std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot create the socket directory ", dir.string(), ": ", ec.message(),
          "; run dosd as a user who may, or pass --socket=$XDG_RUNTIME_DIR/dosd.sock"));
    }
  }
  std::string lock_path = socket_path + ".lock";
  int fd = -1;
  // The lock file is removed on a clean stop, so the file we locked may have
  // been unlinked by its previous owner between our open and flock: only a
  // lock on the file still at the path counts.
  for (int attempt = 0;; ++attempt) {
    fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      return absl::PermissionDeniedError(absl::StrCat("cannot open lock file ", lock_path, ": ",
                                                      std::strerror(errno)));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) break;  // held by a live daemon: below
    struct stat held, at_path;
    if (::fstat(fd, &held) == 0 && ::stat(lock_path.c_str(), &at_path) == 0 &&
        held.st_ino == at_path.st_ino && held.st_dev == at_path.st_dev) {
      break;  // ours
    }
    ::close(fd);
    if (attempt == 10) {
      return absl::UnavailableError(absl::StrCat("lock file ", lock_path,
                                                 " keeps being replaced; is another dosd "
                                                 "starting on the same --socket?"));
    }
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {0};
    ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    std::string owner = n > 0 ? std::string(absl::StripAsciiWhitespace(absl::string_view(buf, n)))
                              : std::string("unknown");
    return absl::AlreadyExistsError(absl::StrCat(
        "another dosd (pid ", owner, ") is serving ", socket_path,
        "; stop it first (systemctl stop dosd, or kill ", owner,
        ") or give this one another --socket"));
  }
  // We own the path now: whatever socket file is there is stale.
  if (::unlink(socket_path.c_str()) != 0 && errno != ENOENT) {
    int err = errno;
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat("cannot remove stale socket ", socket_path,
                                                    ": ", std::strerror(err)));
  }
  std::string pid = absl::StrCat(getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    // The pid is only for the message above; failing to write it is harmless.
  }
  return std::unique_ptr<SocketGuard>(new SocketGuard(socket_path, fd));
}

SocketGuard::~SocketGuard() {
  ::unlink(socket_path_.c_str());
  // A clean stop leaves nothing behind; unlinked while still locked, so a
  // daemon starting now either waits on our lock or creates a fresh file.
  ::unlink((socket_path_ + ".lock").c_str());
  ::close(lock_fd_);
}

}  // namespace dos
