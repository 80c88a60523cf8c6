#include "daemon/common/sd_notify.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"

namespace dos {

absl::Status SdNotify(absl::string_view state) {
  const char* path = ::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return absl::OkStatus();
  const size_t len = ::strlen(path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET=", path, " is not an absolute or abstract socket path"));
  }
  ::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);

  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("sd_notify: socket: ", ::strerror(errno)));
  }
  ssize_t n;
  do {
    n = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                 reinterpret_cast<const sockaddr*>(&addr), addr_len);
  } while (n < 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  if (n < 0) {
    return absl::UnavailableError(
        absl::StrCat("sd_notify to ", path, ": ", ::strerror(err)));
  }
  return absl::OkStatus();
}

std::optional<absl::Duration> SdWatchdogInterval() {
  const char* usec = ::getenv("WATCHDOG_USEC");
  if (usec == nullptr) return std::nullopt;
  uint64_t us = 0;
  if (!absl::SimpleAtoi(usec, &us) || us == 0) return std::nullopt;
  if (const char* pid = ::getenv("WATCHDOG_PID"); pid != nullptr) {
    int64_t p = 0;
    if (!absl::SimpleAtoi(pid, &p) || p != ::getpid()) return std::nullopt;
  }
  return absl::Microseconds(static_cast<int64_t>(us));
}

SdWatchdog::SdWatchdog(std::function<bool()> healthy) : healthy_(std::move(healthy)) {
  std::optional<absl::Duration> interval = SdWatchdogInterval();
  if (!interval.has_value()) return;
  thread_ = std::thread([this, period = *interval / 2] { Loop(period); });
  ::pthread_setname_np(thread_.native_handle(), "dos-watchdog");
}

SdWatchdog::~SdWatchdog() {
  {
    absl::MutexLock l(&mu_);
    stop_.store(true, std::memory_order_relaxed);
  }
  if (thread_.joinable()) thread_.join();
}

void SdWatchdog::Loop(absl::Duration period) {
  DOS_LOG_INFO("watchdog.start", "period_ms", absl::ToInt64Milliseconds(period));
  bool was_healthy = true;
  auto stopping = [this] { return stop_.load(std::memory_order_relaxed); };
  while (!stopping()) {
    const bool healthy = healthy_();
    if (healthy) {
      absl::Status s = SdNotify("WATCHDOG=1");
      if (!s.ok()) DOS_LOG_WARNING("watchdog.notify_failed", "error", s.message());
    } else if (was_healthy) {
      DOS_LOG_ERROR("watchdog.unhealthy", "action", "withholding WATCHDOG=1");
    }
    was_healthy = healthy;
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping), period);
  }
}

}  // namespace dos
