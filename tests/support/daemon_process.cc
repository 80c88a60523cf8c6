#include "tests/support/daemon_process.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dos/wire/fd_protocol.h"

namespace dos::testing {

bool SocketAccepts(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

namespace {

void RemoveTestDir(const std::string& dir) {
  const char* keep = std::getenv("DOS_KEEP_TEST_DIRS");
  if (dir.empty() || (keep != nullptr && std::string(keep) == "1")) return;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace

DaemonProcess::DaemonProcess(std::vector<std::string> extra_flags)
    : flags_(std::move(extra_flags)) {
  char tmpl[] = "/tmp/dos-it-XXXXXX";
  dir_ = ::mkdtemp(tmpl);
  socket_ = dir_ + "/dosd.sock";
  log_path_ = dir_ + "/dosd.log";
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  // The socket folder, dosd's log and its checkpoints go with the test
  // (DOS_KEEP_TEST_DIRS=1 keeps them for a post-mortem).
  RemoveTestDir(dir_);
}

TempDir::TempDir(const std::string& prefix) {
  std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
  path_ = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
}

TempDir::~TempDir() { RemoveTestDir(path_); }

void DaemonProcess::RunAs(uid_t uid, gid_t gid, mode_t umask, std::string binary) {
  run_as_ = true;
  binary_ = std::move(binary);
  uid_ = uid;
  gid_ = gid;
  umask_ = umask;
}

bool DaemonProcess::Start() {
  if (run_as_ && (::chown(dir_.c_str(), uid_, gid_) != 0 || ::chmod(dir_.c_str(), 0750) != 0)) {
    return false;
  }
  // $DOS_DOSD overrides the build tree's dosd (tests run from an install).
  const char* env = std::getenv("DOS_DOSD");
  std::vector<std::string> args = {!binary_.empty()                   ? binary_
                                   : env != nullptr && env[0] != '\0' ? env
                                                                       : DOS_DOSD_PATH,
                                   "--socket=" + socket_,
                                   "--checkpoint_dir=" + dir_ + "/checkpoints"};
  args.insert(args.end(), flags_.begin(), flags_.end());
  pid_ = ::fork();
  if (pid_ == 0) {
    int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(log, STDERR_FILENO);
    if (run_as_) {
      ::umask(umask_);
      if (::setgroups(0, nullptr) != 0 || ::setgid(gid_) != 0 || ::setuid(uid_) != 0) {
        ::_exit(126);
      }
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (SocketAccepts(socket_)) return true;
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling a condition
  }
  return false;
}

int DaemonProcess::WaitExit(int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

int DaemonProcess::Stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  return WaitExit(20000);
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string DaemonProcess::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string FdTicket(const std::string& socket) {
  absl::StatusOr<std::string> t = fdproto::Hello(fdproto::SocketPathFor(socket));
  return t.ok() ? *t : std::string();
}

}  // namespace dos::testing
