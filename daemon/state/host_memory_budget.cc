#include "daemon/state/host_memory_budget.h"

#include <fcntl.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {

absl::Status HostMemoryBudget::Reserve(uint64_t bytes, absl::string_view what) {
  return Reserve(bytes, what, "host optimizer state",
                 "raise dosd --host_memory_limit, detach other sessions, or register a smaller "
                 "shard");
}

absl::Status HostMemoryBudget::Reserve(uint64_t bytes, absl::string_view what,
                                       absl::string_view held_as, absl::string_view fix) {
  std::vector<Held> freed;  // destroyed after the lock: closing frees their memory
  absl::MutexLock lock(&mu_);
  auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return limit_ != 0 && (bytes > limit_ || used_ > limit_ - bytes);
  };
  if (over() && !held_.empty()) ReapViewsLocked(&freed);
  if (over()) {
    const std::string viewed =
        held_bytes_ == 0
            ? std::string()
            : absl::StrCat("; ", FormatBytes(held_bytes_), " of it is the state of ", held_.size(),
                           " closed session(s) whose state_dict() views a trainer still holds "
                           "(possibly another user's: `dosctl stats` shows each uid's STATE "
                           "VIEWS; its owner frees it by dropping those state dicts, or by "
                           "ending that trainer and any child it forked, such as DataLoader "
                           "workers)");
    const std::string staging =
        staging_bytes_ == 0
            ? std::string()
            : absl::StrCat("; ", FormatBytes(staging_bytes_),
                           " of it is checkpoint staging: copies of state that checkpoints in "
                           "progress have not written yet, freed as they are written (retry "
                           "once the saves finish, or lower dosd --checkpoint_staging_limit)");
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", FormatBytes(bytes), " (", bytes, " bytes) of ", held_as, ", but ",
        FormatBytes(used_), " of the daemon's ", FormatBytes(limit_), " limit is in use (",
        FormatBytes(limit_ - used_), " free); ", fix, viewed, staging));
  }
  used_ += bytes;
  return absl::OkStatus();
}

void HostMemoryBudget::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  ReleaseLocked(bytes);
}

absl::Status HostMemoryBudget::ReserveStaging(uint64_t bytes) {
  DOS_RETURN_IF_ERROR(Reserve(bytes, "a checkpoint's copy-on-write", "checkpoint staging",
                              "the step waits for the checkpoint writer instead"));
  absl::MutexLock lock(&mu_);
  staging_bytes_ += bytes;
  return absl::OkStatus();
}

void HostMemoryBudget::ReleaseStaging(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  staging_bytes_ = bytes > staging_bytes_ ? 0 : staging_bytes_ - bytes;
  ReleaseLocked(bytes);
}

void HostMemoryBudget::HoldWhileViewed(UniqueFd file, uint64_t bytes, LedgerCharge charge,
                                       LedgerCharge state_charge) {
  // Outlives the lock (see freed below).
  Held held{std::move(file), bytes, std::move(charge), std::move(state_charge)};
  absl::MutexLock lock(&mu_);
  if (held.file.valid() && StillViewed(held.file.get())) {
    held_bytes_ += bytes;
    held_.push_back(std::move(held));
    return;
  }
  ReleaseLocked(bytes);
}

void HostMemoryBudget::HoldBlockWhileMapped(UniqueFd file, LedgerCharge charge) {
  Held held{std::move(file), 0, std::move(charge), LedgerCharge()};
  absl::MutexLock lock(&mu_);
  if (held.file.valid() && StillViewed(held.file.get())) blocks_.push_back(std::move(held));
}

uint64_t HostMemoryBudget::held_blocks() const {
  absl::MutexLock lock(&mu_);
  return blocks_.size();
}

void HostMemoryBudget::ReapViews() {
  std::vector<Held> freed;  // destroyed after the lock: closing frees their memory
  absl::MutexLock lock(&mu_);
  ReapViewsLocked(&freed);
}

namespace {

// Moves the entries of `list` that nothing views any more to `freed`;
// returns their bytes.
template <typename Held>
uint64_t MoveUnviewed(std::vector<Held>* list, std::vector<Held>* freed) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < list->size();) {
    if (StillViewed((*list)[i].file.get())) {
      ++i;
      continue;
    }
    bytes += (*list)[i].bytes;
    freed->push_back(std::move((*list)[i]));
    if (i + 1 != list->size()) std::swap((*list)[i], list->back());
    list->pop_back();
  }
  return bytes;
}

}  // namespace

void HostMemoryBudget::ReapViewsLocked(std::vector<Held>* freed) {
  // Closing the last descriptor frees the state (seconds for 100 GB), so the
  // caller does it after the lock; so is the uid's charge given back.
  const uint64_t bytes = MoveUnviewed(&held_, freed);
  ReleaseLocked(bytes);
  held_bytes_ -= bytes;
  MoveUnviewed(&blocks_, freed);  // control blocks: no bytes of the budget's
}

uint64_t HostMemoryBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

HostMemoryBudget::Viewed HostMemoryBudget::viewed() const {
  absl::MutexLock lock(&mu_);
  return Viewed{held_bytes_, held_.size()};
}

bool StillViewed(int file) {
  if (::fcntl(file, F_SETLEASE, F_WRLCK) == 0) {
    ::fcntl(file, F_SETLEASE, F_UNLCK);
    return false;
  }
  const int err = errno;
  if (err == EAGAIN) return true;
  // Leases off (fs.leases-enable=0: EINVAL) or refused (EACCES, EPERM): the
  // views cannot be told apart, so the memory is released with its session.
  // Anything else may pass: asked again at the next reap.
  const bool untracked = err == EINVAL || err == EACCES || err == EPERM;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    DOS_LOG_WARNING("state.views_not_tracked", "error", std::strerror(err), "fix",
                    untracked ? "enable file leases (sysctl fs.leases-enable=1): without them "
                                "the memory of closed sessions whose state_dict() views a "
                                "trainer still holds is not charged to --host_memory_limit"
                              : "none; asked again once a second");
  }
  return !untracked;
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
