// systemd readiness and watchdog notifications (sd_notify(3)) without
// libsystemd: one datagram per message to the unix socket named by
// $NOTIFY_SOCKET ('@' prefix = abstract namespace). Outside systemd (no
// $NOTIFY_SOCKET) every call is a no-op that returns OK.
//
//   SdNotify("READY=1");                  // after the socket accepts calls
//   SdWatchdog watchdog(healthy);          // WATCHDOG=1 every WatchdogSec/2
//   SdNotify("STOPPING=1");               // on SIGTERM, before draining
//
// Thread-safety: SdNotify is thread-safe. SdWatchdog owns one named thread
// ("dos-watchdog") and joins it on destruction.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dos {

// Sends `state` (newline-separated VAR=value assignments) to systemd.
absl::Status SdNotify(absl::string_view state);

// The watchdog interval systemd expects pings within ($WATCHDOG_USEC, when
// $WATCHDOG_PID is unset or names this process); nullopt when disabled.
std::optional<absl::Duration> SdWatchdogInterval();

// Pings WATCHDOG=1 at half the interval for as long as `healthy()` returns
// true. A daemon whose gRPC server or sessions wedge stops answering
// `healthy()`, systemd sees no ping for WatchdogSec, and restarts it
// (Restart=on-failure covers the watchdog). Does nothing when systemd did
// not enable the watchdog.
class SdWatchdog {
 public:
  explicit SdWatchdog(std::function<bool()> healthy);
  ~SdWatchdog();
  SdWatchdog(const SdWatchdog&) = delete;
  SdWatchdog& operator=(const SdWatchdog&) = delete;

  bool enabled() const { return thread_.joinable(); }

 private:
  void Loop(absl::Duration period);

  const std::function<bool()> healthy_;
  // An atomic, not ABSL_GUARDED_BY(mu_): Debian's abseil is not built for
  // TSan, which therefore cannot see mu_ order accesses; mu_ only wakes the
  // sleeping loop.
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::thread thread_;
};

}  // namespace dos
