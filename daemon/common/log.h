// Structured logging to stderr for journald: one event per line,
//   ts=2026-11-29T17:40:00.123Z level=info event=session.attach session=3 pid=812
// Values that contain spaces, quotes or '=' are quoted. Thread-safe: each line
// is assembled first and written with a single write(2).
//
//   DOS_LOG_INFO("session.attach", "session", id, "pid", pid);
//
// Arguments after the event name alternate key, value. Nothing in a hot loop
// (per tile, per element) may log; per step is the finest grain allowed, and
// only at debug level. Warnings and errors are rate-limited per event (10
// lines per 10 s), info lines per event and uid (20 per 10 s, keyed on the
// line's uid= field when it has one); the next line says suppressed=N.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <type_traits>
#include "absl/strings/string_view.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dos {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below this level are dropped. Set once from main() (--log_level).
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
// Parses "debug", "info", "warning", "error".
bool ParseLogLevel(absl::string_view text, LogLevel* out);

namespace log_internal {
// Repeated warnings and errors of one event (a trainer whose every step
// fails, a peer retrying a refused call) are rate-limited: at most
// `lines_per_window` lines per event per `window`; the first line of the
// next window carries suppressed=<lines left out>. Thread-safe.
class RateLimiter {
 public:
  RateLimiter(int lines_per_window, absl::Duration window)
      : lines_per_window_(lines_per_window), window_(window) {}
  struct Decision {
    bool emit = true;
    uint64_t suppressed_before = 0;  // lines of this event left out before this one
    bool first_suppressed = false;   // this is the window's first line left out
  };
  Decision Admit(absl::string_view event, absl::Time now);
  // The events with lines left out and not yet reported (a later line
  // reports them as suppressed=N), each with its count; resets them.
  std::vector<std::pair<std::string, uint64_t>> TakeSuppressed();

 private:
  struct Window {
    absl::Time start = absl::InfinitePast();
    int lines = 0;
    uint64_t suppressed = 0;
  };
  static constexpr size_t kMaxWindows = 4096;  // past it, idle windows are dropped
  const int lines_per_window_;
  const absl::Duration window_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);
  // The last drop of idle windows: at most one scan a window, also when
  // none of kMaxWindows is idle (each line would scan them all).
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

void AppendField(std::string* line, absl::string_view key, absl::string_view value);
// The rate limit's key of a line: "<event> uid=<n>" where its fields (as
// AppendField writes them) name a uid, else "<event>". A uid=... inside a
// quoted value (a client's name) is not the line's.
std::string LimitKey(absl::string_view event, absl::string_view fields);
// Writes one log.suppressed line per event (and uid) whose left-out lines no
// later line has reported yet (at exit: nothing goes uncounted).
void FlushSuppressed();
void Emit(LogLevel level, absl::string_view event, const std::string& fields);

inline void AppendFields(std::string*) {}
template <typename V, typename... Rest>
void AppendFields(std::string* line, absl::string_view key, const V& value, const Rest&... rest) {
  // Debian's abseil keeps absl::string_view distinct from std::string_view.
  if constexpr (std::is_convertible_v<const V&, std::string_view>) {
    std::string_view sv = value;
    AppendField(line, key, absl::string_view(sv.data(), sv.size()));
  } else {
    AppendField(line, key, absl::StrCat(value));
  }
  AppendFields(line, rest...);
}
}  // namespace log_internal

template <typename... KV>
void LogEvent(LogLevel level, absl::string_view event, const KV&... kv) {
  static_assert(sizeof...(KV) % 2 == 0, "LogEvent takes key, value pairs");
  if (level < MinLogLevel()) return;
  std::string fields;
  log_internal::AppendFields(&fields, kv...);
  log_internal::Emit(level, event, fields);
}

}  // namespace dos

#define DOS_LOG_DEBUG(...) ::dos::LogEvent(::dos::LogLevel::kDebug, __VA_ARGS__)
#define DOS_LOG_INFO(...) ::dos::LogEvent(::dos::LogLevel::kInfo, __VA_ARGS__)
#define DOS_LOG_WARNING(...) ::dos::LogEvent(::dos::LogLevel::kWarning, __VA_ARGS__)
#define DOS_LOG_ERROR(...) ::dos::LogEvent(::dos::LogLevel::kError, __VA_ARGS__)
