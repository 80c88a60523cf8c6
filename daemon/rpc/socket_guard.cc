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
#include "dos/wire/fd_protocol.h"

namespace dos {

namespace {

// OK when `path` is absent or a socket (a crashed daemon's, which Claim's
// caller replaces); a file of any other kind is someone's, never removed.
absl::Status CheckReplaceable(const std::string& path, const std::string& socket_path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || S_ISSOCK(st.st_mode)) return absl::OkStatus();
  const char* kind = S_ISREG(st.st_mode)   ? "a regular file"
                     : S_ISDIR(st.st_mode) ? "a directory"
                     : S_ISLNK(st.st_mode) ? "a symbolic link"
                                           : "a file that is not a socket";
  return absl::FailedPreconditionError(
      absl::StrCat(path, " is ", kind,
                   ", not a socket: dosd replaces only a stale socket there and "
                   "removes nothing else; give --socket another path (now --socket=",
                   socket_path, "), or move that file away if it is not needed"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketGuard>> SocketGuard::Claim(const std::string& socket_path) {
  if (socket_path.empty() || socket_path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket \"", socket_path, "\" must be a path of 1 to ",
        sizeof(sockaddr_un::sun_path) - 1, " characters (a unix socket limit)"));
  }
  // Before anything is created beside it (the lock file).
  for (const std::string& path : {socket_path, fdproto::SocketPathFor(socket_path)}) {
    if (absl::Status st = CheckReplaceable(path, socket_path); !st.ok()) return st;
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
  // A stopping daemon unlinks its lock file before it lets go of the lock, so
  // the file locked here may already be gone from the path: then the lock
  // proves nothing and we try again on the file now there.
  for (int attempt = 0;; ++attempt) {
    fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::PermissionDeniedError(absl::StrCat("cannot open lock file ", lock_path, ": ",
                                                      std::strerror(errno)));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      char buf[32] = {0};
      ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      ::close(fd);
      std::string owner = n > 0
                              ? std::string(absl::StripAsciiWhitespace(absl::string_view(buf, n)))
                              : std::string("unknown");
      return absl::AlreadyExistsError(absl::StrCat(
          "another dosd (pid ", owner, ") is serving ", socket_path,
          "; stop it first (systemctl stop dosd, or kill ", owner,
          ") or give this one another --socket"));
    }
    struct stat held, named;
    if (::fstat(fd, &held) == 0 && ::stat(lock_path.c_str(), &named) == 0 &&
        held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      break;
    }
    ::close(fd);
    if (attempt == 100) {
      return absl::UnavailableError(absl::StrCat(
          "the lock file ", lock_path, " keeps being replaced; is another dosd starting and "
          "stopping on ", socket_path, "?"));
    }
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
  // Unlinked while still locked (Claim re-checks the path after locking), so
  // a clean stop leaves neither the socket nor the lock file behind.
  ::unlink((socket_path_ + ".lock").c_str());
  ::close(lock_fd_);
}

}  // namespace dos
