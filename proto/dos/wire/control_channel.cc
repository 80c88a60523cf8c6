#include "dos/wire/control_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <new>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace dos {

void ControlBlockChannel::InitBlock(ControlBlock* block, uint64_t session_id, pid_t daemon_pid) {
  // Value-initialization zeroes every field, bells included; the atomics are
  // constructed in place, which is how they begin their lifetime in a
  // mapping. The client learns of the block only through the Attach reply,
  // which orders these writes before its first read.
  new (block) ControlBlock{};
  block->session_id = session_id;
  block->daemon_pid = daemon_pid;
  block->version = kProtocolVersion;
  block->magic = kControlBlockMagic;
}

absl::Status ControlBlockChannel::Validate(const ControlBlock* block, uint64_t mapped_bytes) {
  constexpr uint64_t kHeader = sizeof(block->magic) + sizeof(block->version);
  if (mapped_bytes < kHeader || block->magic != kControlBlockMagic) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "control block: not a DOS control block (magic 0x%08x, expected 0x%08x); check the shm "
        "name from the Attach reply",
        mapped_bytes < kHeader ? 0u : block->magic, kControlBlockMagic));
  }
  if (block->version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "control block: dosd speaks protocol version %u, this library speaks %u; run a client "
        "library from the same release as dosd",
        block->version, kProtocolVersion));
  }
  if (mapped_bytes < sizeof(ControlBlock)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("control block: segment has %u bytes, protocol version %u needs %u",
                        mapped_bytes, kProtocolVersion, sizeof(ControlBlock)));
  }
  return absl::OkStatus();
}

bool ControlBlockChannel::ProcessAlive(pid_t pid) {
  // kill(0 or negative) would address process groups, never a peer.
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // kill() succeeds on a zombie (exited, not yet reaped); /proc/<pid>/stat
  // says "pid (comm) Z ...". comm may contain ')' so take the last one. If
  // /proc cannot be read, trust kill().
  char path[32];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;
  char buf[512];
  ssize_t n = read(fd, buf, sizeof(buf));
  close(fd);
  if (n <= 0) return true;
  std::string_view stat(buf, static_cast<size_t>(n));
  size_t paren = stat.rfind(')');
  if (paren == std::string_view::npos || paren + 2 >= stat.size()) return true;
  return stat[paren + 2] != 'Z' && stat[paren + 2] != 'X';
}

bool ControlBlockChannel::DaemonAlive() const {
  if (daemon_connection_ < 0) return ProcessAlive(block_->daemon_pid);
  pollfd p{daemon_connection_, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r == 0;  // dosd never writes on it: readable means hung up
}

void ControlBlockChannel::PostResult(uint32_t seq) {
  block_->result.seq = seq;
  done_.Ring(seq);
}

uint32_t ControlBlockChannel::PublishRequest() {
  // The client is the bell's only writer, so reading our own last value needs
  // no ordering; seq wraps after 2^32 steps, which the waits tolerate (they
  // compare for (in)equality only).
  const uint32_t seq = block_->request_bell.load(std::memory_order_relaxed) + 1;
  block_->request.seq = seq;
  request_.Ring(seq);
  return seq;
}

absl::Status ControlBlockChannel::WaitResult(uint32_t seq, absl::Duration timeout) {
  return WaitBell(done_, seq, timeout, "no result");
}

absl::Status ControlBlockChannel::WaitLeaseApplied(uint32_t seq, absl::Duration timeout) {
  return WaitBell(lease_, seq, timeout, "GPU lease not applied");
}

absl::Status ControlBlockChannel::WaitBell(Doorbell& bell, uint32_t seq, absl::Duration timeout,
                                           const char* what) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  for (;;) {
    // `closed` first: a plain load, and a closed session will never answer.
    if (block_->closed.load(std::memory_order_acquire) != 0 && bell.Load() != seq) {
      return absl::UnavailableError(
          absl::StrCat("step ", seq, ": dosd closed session ", block_->session_id,
                       " (daemon shutdown or detach); attach again to continue"));
    }
    const absl::Duration elapsed = absl::FromChrono(Clock::now() - start);
    const absl::Duration slice = std::min(kLivenessSlice, timeout - elapsed);
    if (bell.WaitFor(seq, slice)) return absl::OkStatus();
    if (!DaemonAlive()) {
      return absl::UnavailableError(absl::StrCat("step ", seq, ": dosd (pid ", block_->daemon_pid,
                                                 ") is gone; restart it and attach again"));
    }
    if (absl::FromChrono(Clock::now() - start) >= timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", seq, ": ", what, " from dosd (pid ", block_->daemon_pid, ") within ",
          absl::FormatDuration(timeout), "; it is alive but slow or stuck, see its log"));
    }
  }
}

absl::Status ControlBlockChannel::WaitSubgroups(uint32_t first, uint32_t last, uint32_t seq,
                                                absl::Duration timeout) {
  // Words only grow (mod 2^32) while one step is in flight.
  uint32_t i = first;
  return PollWords(
      seq, timeout,
      [&] {
        while (i <= last &&
               static_cast<int32_t>(DoneWord(i)->load(std::memory_order_acquire) - seq) >= 0) {
          ++i;
        }
        return i > last;
      },
      [&] { return absl::StrCat("subgroup ", i); }, "updated");
}

absl::Status ControlBlockChannel::WaitCapturesDone(uint32_t seq, absl::Duration timeout) {
  return PollWords(
      seq, timeout,
      [&] {
        return static_cast<int32_t>(block_->capture_done.load(std::memory_order_acquire) - seq) >=
               0;
      },
      [] { return std::string("the gradient captures"); }, "stopped");
}

absl::Status ControlBlockChannel::PollWords(uint32_t seq, absl::Duration timeout,
                                            absl::FunctionRef<bool()> reached,
                                            absl::FunctionRef<std::string()> pending,
                                            const char* verb) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  for (uint64_t spins = 0;; ++spins) {
    if (reached()) return absl::OkStatus();
    if (done_.Load() == seq) {
      // The step is over: every word was stored before the bell rang.
      std::atomic_thread_fence(std::memory_order_acquire);
      continue;
    }
    if (spins < 2000) continue;
    if (spins % 1024 == 0) {
      if (block_->closed.load(std::memory_order_acquire) != 0) {
        return absl::UnavailableError(absl::StrCat("step ", seq, ": dosd closed session ",
                                                   block_->session_id, " while ", pending(),
                                                   " was in flight; attach again to continue"));
      }
      if (!DaemonAlive()) {
        return absl::UnavailableError(absl::StrCat("step ", seq, ": dosd (pid ",
                                                   block_->daemon_pid,
                                                   ") is gone; restart it and attach again"));
      }
      if (absl::FromChrono(Clock::now() - start) >= timeout) {
        return absl::DeadlineExceededError(absl::StrCat(
            "step ", seq, ": ", pending(), " not ", verb, " within ", absl::FormatDuration(timeout),
            "; dosd is alive but slow or stuck, see its log"));
      }
    }
    // Sub-millisecond granularity: a subgroup takes milliseconds.
    absl::SleepFor(absl::Microseconds(20));
  }
}

}  // namespace dos
