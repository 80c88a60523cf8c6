#include "daemon/common/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace dos {
namespace {
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}
}  // namespace

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load(std::memory_order_relaxed)); }

bool ParseLogLevel(absl::string_view text, LogLevel* out) {
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    if (text == LevelName(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

namespace log_internal {

void AppendField(std::string* line, absl::string_view key, absl::string_view value) {
  absl::StrAppend(line, " ", key, "=");
  // Control bytes (a CR, an escape sequence: a client's tensor name) are
  // written as \xNN, so no value can forge a line or rewrite the terminal.
  auto control = [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; };
  bool quote = value.empty() || value.find_first_of(" \"=") != absl::string_view::npos ||
               std::any_of(value.begin(), value.end(), control);
  if (!quote) {
    absl::StrAppend(line, value);
    return;
  }
  line->push_back('"');
  for (char c : value) {
    if (c == '"' || c == '\\') line->push_back('\\');
    if (c == '\n') {
      line->append("\\n");
    } else if (control(c)) {
      absl::StrAppendFormat(line, "\\x%02x", static_cast<unsigned char>(c));
    } else {
      line->push_back(c);
    }
  }
  line->push_back('"');
}

RateLimiter::Decision RateLimiter::Admit(absl::string_view event, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (windows_.size() >= kMaxWindows && now - last_sweep_ >= window_) {
    last_sweep_ = now;
    // Windows of past spells with nothing left to report go (keys carry a
    // uid: a node's users over months).
    for (auto it = windows_.begin(); it != windows_.end();) {
      const bool idle = it->second.suppressed == 0 && now - it->second.start >= window_;
      idle ? windows_.erase(it++) : void(++it);
    }
  }
  Window& w = windows_[std::string(event)];
  Decision d;
  if (now - w.start >= window_) {
    d.suppressed_before = w.suppressed;
    w = Window{now, 0, 0};
  }
  if (w.lines >= lines_per_window_) {
    d.first_suppressed = w.suppressed == 0;
    ++w.suppressed;
    d.emit = false;
    return d;
  }
  ++w.lines;
  d.emit = true;
  return d;
}

std::vector<std::pair<std::string, uint64_t>> RateLimiter::TakeSuppressed() {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, uint64_t>> out;
  for (auto& [event, w] : windows_) {
    if (w.suppressed == 0) continue;
    out.emplace_back(event, w.suppressed);
    w.suppressed = 0;
  }
  return out;
}

std::string LimitKey(absl::string_view event, absl::string_view fields) {
  bool quoted = false;
  for (size_t i = 0; i < fields.size(); ++i) {
    const char c = fields[i];
    if (quoted) {
      if (c == '\\') {
        ++i;  // \" or \\ inside a quoted value
      } else if (c == '"') {
        quoted = false;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ' ' && fields.substr(i, 5) == " uid=") {
      const size_t end = fields.find(' ', i + 1);
      return absl::StrCat(event, fields.substr(i, end == absl::string_view::npos ? end : end - i));
    }
  }
  return std::string(event);
}

namespace {
// Warnings and errors: at most 10 lines per event (and uid) per 10 s, so one
// user's refused calls do not hide another's; the next line after a quiet
// spell says how many were left out (suppressed=N).
RateLimiter& Limiter() {
  static RateLimiter* const limiter = new RateLimiter(10, absl::Seconds(10));
  return *limiter;
}
// Info lines: at most 20 per event and uid per 10 s, so one user's attach
// loop neither floods the journal nor hides another user's lines.
RateLimiter& InfoLimiter() {
  static RateLimiter* const limiter = new RateLimiter(20, absl::Seconds(10));
  return *limiter;
}

std::string Timestamp(absl::Time now) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone());
}
}  // namespace

void FlushSuppressed() {
  const std::string ts = Timestamp(absl::Now());
  for (RateLimiter* limiter : {&Limiter(), &InfoLimiter()}) {
    for (const auto& [key, n] : limiter->TakeSuppressed()) {
      const std::string line = absl::StrCat("ts=", ts, " level=info event=log.suppressed "
                                            "limited_event=", key, " suppressed=", n, "\n");
      ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
      (void)unused;
    }
  }
}

void Emit(LogLevel level, absl::string_view event, const std::string& fields) {
  const absl::Time now = absl::Now();
  std::string suppressed;
  if (level >= LogLevel::kInfo) {
    const bool info = level == LogLevel::kInfo;
    const std::string key = LimitKey(event, fields);
    RateLimiter::Decision d = (info ? InfoLimiter() : Limiter()).Admit(key, now);
    if (!d.emit) {
      if (!d.first_suppressed) return;
      // Say once that lines are being left out, and how the count is reported.
      const std::string note = absl::StrCat(
          "ts=", Timestamp(now), " level=warning event=log.rate_limited limited_event=", event,
          key.substr(event.size()),
          " note=\"further lines of this event are left out for up to 10s; the next one says "
          "suppressed=N\"\n");
      ssize_t unused = ::write(STDERR_FILENO, note.data(), note.size());
      (void)unused;
      return;
    }
    if (d.suppressed_before > 0) suppressed = absl::StrCat(" suppressed=", d.suppressed_before);
  }
  std::string line = absl::StrCat("ts=", Timestamp(now), " level=", LevelName(level),
                                  " event=", event, fields, suppressed, "\n");
  // One write(2) per line keeps lines whole when threads log at once.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace log_internal
}  // namespace dos
