#include "tests/security/security_env.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

namespace dos::testing {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsers[] = {"dos-sec-d", "dos-sec-a", "dos-sec-e", "dos-sec-b",
                                  "dos-sec-c", "dos-sec-o"};

// Whether every directory above `path` and the file itself may be reached by
// anyone (o+x on directories, o+rx on the file).
bool WorldReachable(const fs::path& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || (st.st_mode & 05) != 05) return false;
  for (fs::path p = path.parent_path(); !p.empty(); p = p.parent_path()) {
    if (::stat(p.c_str(), &st) != 0 || (st.st_mode & 01) == 0) return false;
    if (p == p.root_path()) break;
  }
  return true;
}

pid_t SpawnAs(const SecUser& user, const std::vector<std::string>& argv, int in_fd, int out_fd,
              int err_fd) {
  std::vector<std::string> args = argv;
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  ::dup2(in_fd, STDIN_FILENO);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  if (::setgroups(user.groups.size(), user.groups.data()) != 0 || ::setgid(user.gid) != 0 ||
      ::setuid(user.uid) != 0) {
    ::_exit(126);
  }
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  ::execv(cargv[0], cargv.data());
  ::_exit(127);
}

}  // namespace

std::string SecuritySkipReason() {
  if (::geteuid() != 0) {
    return "security tests need root: they create throwaway users (tests/security/users.sh) and "
           "run dosd and trainers as them; run ctest -L security as root, as CI does";
  }
  for (const char* u : kUsers) {
    if (::getpwnam(u) == nullptr) {
      return std::string("fixture user ") + u +
             " is missing; run the tests through ctest (its fixture dos_security_users runs "
             "tests/security/users.sh create) or run that script first";
    }
  }
  return "";
}

SecUser User(const std::string& name) {
  SecUser u;
  u.name = name;
  const passwd* pw = ::getpwnam(name.c_str());
  if (pw == nullptr) return u;
  u.uid = pw->pw_uid;
  u.gid = pw->pw_gid;
  int n = 64;
  std::vector<gid_t> groups(n);
  if (::getgrouplist(name.c_str(), u.gid, groups.data(), &n) >= 0) {
    groups.resize(n);
    u.groups = groups;
  }
  return u;
}

gid_t Group(const std::string& name) {
  const group* g = ::getgrnam(name.c_str());
  return g == nullptr ? static_cast<gid_t>(-1) : g->gr_gid;
}

std::string ReachableBinary(const std::string& path) {
  static std::map<std::string, std::string> copies;
  if (WorldReachable(path)) return path;
  auto it = copies.find(path);
  if (it != copies.end()) return it->second;
  static std::string dir = [] {
    char tmpl[] = "/tmp/dos-sec-bin-XXXXXX";
    std::string d = ::mkdtemp(tmpl);
    ::chmod(d.c_str(), 0755);
    return d;
  }();
  const std::string to = dir + "/" + fs::path(path).filename().string();
  std::error_code ec;
  fs::copy_file(path, to, fs::copy_options::overwrite_existing, ec);
  ::chmod(to.c_str(), 0755);
  copies[path] = to;
  return to;
}

std::unique_ptr<DaemonProcess> SecureDaemon(std::vector<std::string> flags) {
  flags.insert(flags.begin(), {"--group=dos-sec", "--socket_mode=0660"});
  auto d = std::make_unique<DaemonProcess>(std::move(flags));
  const SecUser du = User("dos-sec-d");
  const char* env = std::getenv("DOS_DOSD");
  d->RunAs(du.uid, du.gid, 0007,
           ReachableBinary(env != nullptr && env[0] != '\0' ? env : DOS_DOSD_PATH));
  return d;
}

std::vector<std::string> ClientArgv(const std::string& binary, const std::string& target,
                                    std::vector<std::string> ops) {
  std::vector<std::string> argv = {ReachableBinary(binary), target};
  argv.insert(argv.end(), ops.begin(), ops.end());
  return argv;
}

UserProcess::UserProcess(const SecUser& user, const std::string& target,
                         std::vector<std::string> ops)
    : UserProcess(user, ClientArgv(DOS_SEC_CLIENT_PATH, target, std::move(ops))) {}

UserProcess::UserProcess(const SecUser& user, std::vector<std::string> argv) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return;
  int devnull = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  pid_ = SpawnAs(user, argv, in[0], out[1], getenv("DOS_SEC_VERBOSE") ? STDERR_FILENO : devnull);
  ::close(devnull);
  ::close(in[0]);
  ::close(out[1]);
  in_ = in[1];
  outfd_ = out[0];
}

UserProcess::~UserProcess() {
  if (pid_ > 0) Finish(5000);
  if (pid_ > 0) Kill();
  if (outfd_ >= 0) ::close(outfd_);
}

bool UserProcess::ReadMore(int timeout_ms) {
  if (outfd_ < 0) return false;
  pollfd p{outfd_, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return false;
  char buf[4096];
  ssize_t n = ::read(outfd_, buf, sizeof buf);
  if (n <= 0) {
    ::close(outfd_);
    outfd_ = -1;
    return false;
  }
  out_.append(buf, static_cast<size_t>(n));
  return true;
}

std::string UserProcess::Await(const std::string& op, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    size_t nl;
    while ((nl = out_.find('\n', consumed_)) != std::string::npos) {
      std::string line = out_.substr(consumed_, nl - consumed_);
      consumed_ = nl + 1;
      if (line.rfind("OK " + op, 0) == 0 || line.rfind("ERR " + op, 0) == 0) return line;
    }
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    if (left <= 0 || !ReadMore(left)) return "";
  }
}

void UserProcess::Continue() {
  if (in_ >= 0) (void)!::write(in_, "\n", 1);
}

std::string UserProcess::Finish(int timeout_ms) {
  if (in_ >= 0) {
    ::close(in_);
    in_ = -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (outfd_ >= 0 && std::chrono::steady_clock::now() < deadline) ReadMore(100);
  while (pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) pid_ = -1;
    else std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling a condition
  }
  return out_;
}

void UserProcess::Kill() {
  // SIGKILL before closing stdin: a client blocked in `wait` ends at the end
  // of its input and detaches cleanly, which is not the death a test asks for
  // (under load it won the race: IdentityTest saw a detach, not an orphan).
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  if (in_ >= 0) {
    ::close(in_);
    in_ = -1;
  }
}

std::string RunAs(const SecUser& user, const std::string& target, std::vector<std::string> ops) {
  UserProcess p(user, target, std::move(ops));
  return p.Finish(60000);
}

std::string RunCommandAs(const SecUser& user, std::vector<std::string> argv) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return "";
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  pid_t pid = SpawnAs(user, argv, devnull, out[1], out[1]);
  ::close(devnull);
  ::close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  ::waitpid(pid, nullptr, 0);
  return text;
}

std::string Field(const std::string& line, const std::string& key) {
  const std::string k = " " + key + "=";
  size_t at = line.find(k);
  if (at == std::string::npos) return "";
  at += k.size();
  return line.substr(at, line.find_first_of(" \n", at) - at);
}

int Code(const std::string& line) {
  if (line.rfind("OK ", 0) == 0) return 0;
  if (line.rfind("ERR ", 0) != 0) return -1;
  const std::string c = Field(line, "code");
  return c.empty() ? -1 : std::stoi(c);
}

bool WaitFor(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling a condition
  }
  return pred();
}

void SecureDaemonTest::StartDaemon(std::vector<std::string> flags) {
  daemon_ = SecureDaemon(std::move(flags));
  ASSERT_TRUE(daemon_->Start()) << daemon_->log();
}

void SecureDaemonTest::StopDaemon() {
  if (daemon_ == nullptr) return;
  EXPECT_EQ(daemon_->Stop(), 0) << daemon_->log();
  daemon_.reset();
}

void SecureDaemonTest::TearDown() {
  StopDaemon();
  for (const std::string& dir : dirs_) fs::remove_all(dir);
}

std::string SecureDaemonTest::DaemonOwnedDir(const std::string& what) {
  std::string tmpl = "/tmp/dos-sec-" + what + "-XXXXXX";
  std::string dir = ::mkdtemp(tmpl.data());
  dirs_.push_back(dir);
  const SecUser d = User("dos-sec-d");
  ::chown(dir.c_str(), d.uid, d.gid);
  return dir;
}

}  // namespace dos::testing
