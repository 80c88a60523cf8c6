#include "daemon/common/log.h"

#include <unistd.h>

#include <atomic>

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
  bool quote = value.empty() || value.find_first_of(" \t\"=\n") != absl::string_view::npos;
  if (!quote) {
    absl::StrAppend(line, value);
    return;
  }
  line->push_back('"');
  for (char c : value) {
    if (c == '"' || c == '\\') line->push_back('\\');
    if (c == '\n') {
      line->append("\\n");
      continue;
    }
    line->push_back(c);
  }
  line->push_back('"');
}

void Emit(LogLevel level, absl::string_view event, const std::string& fields) {
  std::string line = absl::StrCat(
      "ts=", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
      " level=", LevelName(level), " event=", event, fields, "\n");
  // One write(2) per line keeps lines whole when threads log at once.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace log_internal
}  // namespace dos
