// dosd's file descriptors (RLIMIT_NOFILE): the limit raised at start, a
// reserve kept for users who hold nothing yet, and a log line when they run
// out.
//
// Every session costs dosd descriptors (its control block, the trainer's
// pidfd, its connections, its segments), so one user's many sessions could
// take them all and leave the next user's Attach failing. The soft limit is
// raised to the hard one at start (a dosd started by hand keeps the shell's
// 1024 otherwise; the unit's LimitNOFILE sets both); the last `reserve`
// descriptors below it are kept for uids that hold few sessions (fewer than
// reserve / 32, at least one; a session costs dosd 3 to 8 descriptors): while
// a new descriptor-socket connection's descriptor falls in them, a uid that
// holds more is refused (RESOURCE_EXHAUSTED naming the numbers and the fix),
// so a new user's trainer still attaches, fetches its control block and
// sends its segments. A descriptor's number is the lowest free one, so it
// tells how many are open without counting.
//
// Thread-safety: FdReserve is immutable after construction.
#pragma once

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dos {

struct FileLimit {
  uint64_t soft_before = 0;
  uint64_t soft = 0;
  uint64_t hard = 0;
};

// Raises the soft RLIMIT_NOFILE to the hard one and logs daemon.file_limit.
FileLimit RaiseFileLimit();

class FdReserve {
 public:
  // `reserve` descriptors below `limit` (the soft limit) are kept.
  FdReserve(uint64_t limit, uint64_t reserve) : limit_(limit), reserve_(reserve) {}
  // At dosd's start: RaiseFileLimit(), then keep `reserve` (at most a
  // quarter of the limit) below it.
  static FdReserve AtStart(uint64_t reserve);

  // True when descriptor `fd` lies in the reserve.
  bool InReserve(int fd) const {
    return reserve_ != 0 && static_cast<uint64_t>(fd) + reserve_ >= limit_;
  }
  // RESOURCE_EXHAUSTED for uid `uid` holding `sessions` sessions (not few)
  // when its new connection got descriptor `fd` in the reserve; OK otherwise.
  // Logs the refusal (rate-limited).
  absl::Status Admit(int fd, uint32_t uid, uint64_t sessions) const;
  // Sessions a uid may hold and still be served from the reserve.
  uint64_t few_sessions() const { return std::max<uint64_t>(1, reserve_ / 32); }

  uint64_t limit() const { return limit_; }
  uint64_t reserve() const { return reserve_; }

 private:
  const uint64_t limit_;
  const uint64_t reserve_;
};

// Logs (rate-limited, as every warning) that a descriptor could not be had at
// `where` (errno `err`: EMFILE, ENFILE), with the limit and the fix.
void LogOutOfDescriptors(absl::string_view where, int err);

}  // namespace dos
