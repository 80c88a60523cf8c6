#include "daemon/metrics/metrics_http_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/time.h>

#include <algorithm>
#include <utility>
#include <atomic>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/common/log.h"
#include "daemon/metrics/metrics_registry.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

constexpr size_t kMaxRequestBytes = 8192;

// A parsed IP literal as a sockaddr.
struct Address {
  sockaddr_storage storage{};
  socklen_t len = 0;
  bool loopback = false;
};

bool ParseHost(const std::string& host, uint16_t port, Address* out) {
  const std::string h = host == "localhost" ? "127.0.0.1" : host;
  in_addr v4;
  in6_addr v6;
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    auto* a = reinterpret_cast<sockaddr_in*>(&out->storage);
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    a->sin_addr = v4;
    out->len = sizeof(sockaddr_in);
    out->loopback = (ntohl(v4.s_addr) >> 24) == 127;
    return true;
  }
  std::string bare = h;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  if (::inet_pton(AF_INET6, bare.c_str(), &v6) == 1) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&out->storage);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(port);
    a->sin6_addr = v6;
    out->len = sizeof(sockaddr_in6);
    out->loopback = IN6_IS_ADDR_LOOPBACK(&v6);
    return true;
  }
  return false;
}

void WriteAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the client went away; nothing to report to it
    off += static_cast<size_t>(n);
  }
}

std::string Response(int code, absl::string_view reason, absl::string_view content_type,
                     absl::string_view body, absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", body);
}

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  Address a;
  return ParseHost(host, 0, &a) && a.loopback;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, Render render) {
  Address addr;
  if (!ParseHost(options.host, options.port, &addr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics host '", options.host, "' is not an IP address; use 127.0.0.1, ::1 or an "
        "address of this machine"));
  }
  if (!addr.loopback && !options.allow_non_loopback) {
    return absl::PermissionDeniedError(absl::StrCat(
        "refusing to serve metrics on ", options.host, ": not a loopback address; the metrics "
        "describe this node's jobs. Bind 127.0.0.1, or allow non-loopback binds explicitly"));
  }
  SocketListenerOptions lo;
  // Room in the kernel's queue while the accept thread makes room (a full
  // queue drops a scraper's SYN, which TCP retries only after a second).
  lo.backlog = 1024;
  lo.accept_flags = SOCK_CLOEXEC | SOCK_NONBLOCK;
  lo.thread_name = "dos-metrics-acc";
  lo.flag = "--metrics_port";
  absl::StatusOr<std::unique_ptr<SocketListener>> listener =
      SocketListener::BindTcp(reinterpret_cast<const sockaddr*>(&addr.storage), addr.len, lo);
  if (!listener.ok()) return listener.status();
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC));
  if (!wake.valid()) return absl::InternalError(absl::StrCat("metrics eventfd: ", strerror(errno)));
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer(
      std::move(*listener), std::move(wake), options.read_timeout, std::move(render)));
  s->thread_ = std::thread([p = s.get()] {
    ::pthread_setname_np(::pthread_self(), "dos-metrics");
    p->Loop();
  });
  // On failure the destructor stops the thread.
  DOS_RETURN_IF_ERROR(
      s->listener_->Serve([p = s.get()](UniqueFd conn) { p->Accepted(std::move(conn)); }));
  DOS_LOG_INFO("metrics.listen", "host", options.host, "port", s->port_);
  return s;
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<SocketListener> listener, UniqueFd wake,
                                     absl::Duration read_timeout, Render render)
    : listener_(std::move(listener)),
      wake_(std::move(wake)),
      port_(listener_->port()),
      read_timeout_(read_timeout),
      render_(std::move(render)) {}

MetricsHttpServer::~MetricsHttpServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // releases an Accepted() waiting for room
  }
  listener_->Stop();
  uint64_t one = 1;
  while (::write(wake_.get(), &one, sizeof one) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
}

void MetricsHttpServer::Accepted(UniqueFd conn) {
  absl::MutexLock lock(&mu_);
  if (!RoomOrStopping()) {
    // Full: the oldest connection goes (an idle one first) rather than this
    // one waiting for a deadline, so idle clients never hold a scrape up.
    ++evict_;
    uint64_t one = 1;
    while (::write(wake_.get(), &one, sizeof one) < 0 && errno == EINTR) {
    }
  }
  mu_.Await(absl::Condition(this, &MetricsHttpServer::RoomOrStopping));
  if (stopping_) return;
  queued_.push_back(std::move(conn));
  ++open_;
  uint64_t one = 1;
  while (::write(wake_.get(), &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void MetricsHttpServer::Loop() {
  // Connections being read, each with its own buffer and deadline: an idle
  // or slow client never delays another's scrape.
  struct Conn {
    UniqueFd fd;
    std::string req;
    absl::Time deadline;
  };
  std::vector<Conn> conns;
  while (true) {
    std::vector<pollfd> fds;
    fds.push_back({wake_.get(), POLLIN, 0});
    absl::Time next = absl::InfiniteFuture();
    for (const Conn& c : conns) {
      fds.push_back({c.fd.get(), POLLIN, 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        next == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1));
    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      DOS_LOG_ERROR("metrics.poll_failed", "error", strerror(errno));
      break;
    }
    const absl::Time now = absl::Now();
    std::vector<Conn> keep;
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      bool done = false;
      if (fds[i + 1].revents != 0) {
        char buf[2048];
        ssize_t got = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
        if (got > 0) {
          c.req.append(buf, static_cast<size_t>(got));
          if (absl::StrContains(c.req, "\r\n\r\n") || c.req.size() > kMaxRequestBytes) {
            Answer(c.fd.get(), c.req);
            done = true;
          }
        } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
          done = true;  // the client went away
        }
      }
      if (!done && now >= c.deadline) done = true;  // a client that sends nothing gets nothing
      if (!done) keep.push_back(std::move(c));
    }
    const size_t closed = conns.size() - keep.size();
    conns = std::move(keep);
    if (fds[0].revents != 0) {
      uint64_t count;
      (void)!::read(wake_.get(), &count, sizeof count);
    }
    absl::MutexLock lock(&mu_);
    open_ -= closed;
    if (stopping_) break;
    for (UniqueFd& q : queued_) {
      conns.push_back(Conn{std::move(q), std::string(), now + read_timeout_});
    }
    queued_.clear();
    for (; evict_ > 0 && open_ >= kMaxConnections && !conns.empty(); --evict_, --open_) {
      // Idle ones (nothing received) first, the oldest of them.
      auto victim = std::min_element(conns.begin(), conns.end(), [](const Conn& x, const Conn& y) {
        return std::make_pair(!x.req.empty(), x.deadline) <
               std::make_pair(!y.req.empty(), y.deadline);
      });
      conns.erase(victim);
    }
    if (open_ < kMaxConnections) evict_ = 0;
  }
}

void MetricsHttpServer::Answer(int fd, const std::string& req) {
  requests_.fetch_add(1, std::memory_order_relaxed);
  // The answer is written blocking, bounded by the read timeout.
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(read_timeout_));
  tv.tv_usec = static_cast<suseconds_t>(
      absl::ToInt64Microseconds(read_timeout_ - absl::Seconds(tv.tv_sec)));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (req.size() > kMaxRequestBytes && !absl::StrContains(req, "\r\n\r\n")) {
    WriteAll(fd, Response(431, "Request Header Fields Too Large", "text/plain",
                          "request too large\n"));
    return;
  }
  const std::string line = req.substr(0, req.find("\r\n"));
  std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    WriteAll(fd, Response(400, "Bad Request", "text/plain", "bad request line\n"));
    return;
  }
  const std::string& method = parts[0];
  std::string target = parts[1];
  target = target.substr(0, target.find('?'));  // Prometheus may add query parameters
  if (target != "/metrics") {
    WriteAll(fd, Response(404, "Not Found", "text/plain", "only /metrics is served here\n"));
    return;
  }
  if (method != "GET") {
    WriteAll(fd, Response(405, "Method Not Allowed", "text/plain", "use GET\n", "Allow: GET\r\n"));
    return;
  }
  WriteAll(fd, Response(200, "OK", MetricsRegistry::kContentType, render_()));
}

}  // namespace dos
