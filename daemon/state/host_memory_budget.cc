#include "daemon/state/host_memory_budget.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dos {

absl::Status HostMemoryBudget::Reserve(uint64_t bytes, absl::string_view what) {
  return Reserve(bytes, what, "host optimizer state",
                 "raise dosd --host_memory_limit, detach other sessions, or register a smaller "
                 "shard");
}

absl::Status HostMemoryBudget::Reserve(uint64_t bytes, absl::string_view what,
                                       absl::string_view held_as, absl::string_view fix) {
  absl::MutexLock lock(&mu_);
  if (limit_ != 0 && (bytes > limit_ || used_ > limit_ - bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", FormatBytes(bytes), " (", bytes, " bytes) of ", held_as,
                     ", but ", FormatBytes(used_), " of the daemon's ", FormatBytes(limit_),
                     " limit is in use (", FormatBytes(limit_ - used_), " free); ", fix));
  }
  used_ += bytes;
  return absl::OkStatus();
}

void HostMemoryBudget::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ = bytes > used_ ? 0 : used_ - bytes;
}

uint64_t HostMemoryBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

std::string FormatBytes(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", v, kUnits[unit]);
}

bool ParseBytes(absl::string_view text, uint64_t* out) {
  uint64_t mult = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K': case 'k': mult = uint64_t{1} << 10; break;
      case 'M': case 'm': mult = uint64_t{1} << 20; break;
      case 'G': case 'g': mult = uint64_t{1} << 30; break;
      case 'T': case 't': mult = uint64_t{1} << 40; break;
      default: break;
    }
    if (mult != 1) text.remove_suffix(1);
  }
  uint64_t v;
  if (!absl::SimpleAtoi(text, &v) || v > UINT64_MAX / mult) return false;
  *out = v * mult;
  return true;
}

}  // namespace dos
