#include "daemon/rpc/peer_auth.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "daemon/common/log.h"

namespace dos {
namespace {

constexpr absl::Duration kTicketLife = absl::Seconds(30);

std::string NewTicket() {
  std::random_device rd;  // /dev/urandom
  std::string t;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&t, absl::StrFormat("%08x", rd()));
  return t;
}

// Supplementary groups of `pid` from /proc (the kernel's view at connect time).
std::vector<gid_t> GroupsOf(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  std::vector<gid_t> out;
  while (std::getline(in, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream ss(line.substr(7));
    unsigned g;
    while (ss >> g) out.push_back(g);
  }
  return out;
}

void WriteLine(int fd, const std::string& line) {
  std::string s = line + "\n";
  (void)!::write(fd, s.data(), s.size());
}

}  // namespace

bool ParseIdList(absl::string_view text, std::vector<uint32_t>* out) {
  out->clear();
  if (text.empty()) return true;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    uint32_t v;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return true;
}

bool PeerAuth::Allowed(const PeerAuthOptions& o, uid_t uid, gid_t gid,
                       const std::vector<gid_t>& groups) {
  auto has = [](const auto& v, auto x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  if (has(o.allow_uids, uid) || has(o.allow_gids, gid)) return true;
  for (gid_t g : groups) {
    if (has(o.allow_gids, g)) return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<PeerAuth>> PeerAuth::Start(const std::string& auth_socket,
                                                          PeerAuthOptions options) {
  if (options.allow_uids.empty() && options.allow_gids.empty()) {
    ::unlink(auth_socket.c_str());  // a stale one would mislead clients
    return std::unique_ptr<PeerAuth>(new PeerAuth(auth_socket, std::move(options), -1, -1));
  }
  sockaddr_un addr{};
  if (auth_socket.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("auth socket path ", auth_socket, " is too long"));
  }
  ::unlink(auth_socket.c_str());  // ours: the gRPC socket's lock is already held
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("auth socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, auth_socket.c_str(), auth_socket.size());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 64) != 0) {
    int err = errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", auth_socket, ": ", std::strerror(err)));
  }
  ::chmod(auth_socket.c_str(), options.socket_mode);
  if (options.group != static_cast<gid_t>(-1) &&
      ::chown(auth_socket.c_str(), static_cast<uid_t>(-1), options.group) != 0) {
    int err = errno;
    ::close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot give ", auth_socket, " group ", options.group, ": ", std::strerror(err)));
  }
  int wake = ::eventfd(0, EFD_CLOEXEC);
  std::unique_ptr<PeerAuth> a(new PeerAuth(auth_socket, std::move(options), fd, wake));
  a->thread_ = std::thread([raw = a.get()] {
    pthread_setname_np(pthread_self(), "dos-auth");
    raw->Loop();
  });
  return a;
}

PeerAuth::PeerAuth(std::string path, PeerAuthOptions options, int listen_fd, int wake_fd)
    : path_(std::move(path)), options_(std::move(options)), listen_fd_(listen_fd), wake_fd_(wake_fd) {}

PeerAuth::~PeerAuth() {
  if (listen_fd_ < 0) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
  ::unlink(path_.c_str());
}

void PeerAuth::Loop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    ::close(fd);
  }
}

void PeerAuth::Serve(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    WriteLine(fd, "DENIED the daemon cannot read the peer's credentials");
    return;
  }
  if (!Allowed(options_, cred.uid, cred.gid, GroupsOf(cred.pid))) {
    DOS_LOG_WARNING("auth.denied", "pid", cred.pid, "uid", cred.uid, "gid", cred.gid);
    WriteLine(fd, absl::StrCat("DENIED uid ", cred.uid, " gid ", cred.gid,
                               " is not in dosd's --allow_uids / --allow_gids; ask the "
                               "operator to add it"));
    return;
  }
  std::string ticket = NewTicket();
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = tickets_.begin(); it != tickets_.end();) {
      it = it->second.expires < now ? tickets_.erase(it) : std::next(it);
    }
    tickets_[ticket] = Ticket{cred.pid, now + kTicketLife};
  }
  WriteLine(fd, "OK " + ticket);
}

absl::Status PeerAuth::Check(absl::string_view ticket, int32_t pid) {
  if (!enabled()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(std::string(ticket));
  if (ticket.empty() || it == tickets_.end() || it->second.expires < absl::Now()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: peer_ticket is missing or expired; this dosd checks peer credentials: connect "
        "to ", path_, " first (the client library does this when the file exists)"));
  }
  const int32_t owner = it->second.pid;
  tickets_.erase(it);
  if (owner != pid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: peer_ticket was issued to pid ", owner, ", not to pid ", pid,
        "; a process may attach only as itself"));
  }
  return absl::OkStatus();
}

}  // namespace dos
