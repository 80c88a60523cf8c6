#include "dos/wire/doorbell.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>

// Memory ordering: why no wake-up is lost.
//
// The waiter, before sleeping:   sleeping.store(1, seq_cst); v = bell.load(seq_cst)
// The ringer:                    bell.store(seq, seq_cst);   s = sleeping.load(seq_cst)
//
// This is the store-buffering pattern. All four accesses are seq_cst, so they
// sit in one total order consistent with each thread's program order, and
// whichever store comes first in it is seen by the other side's later load.
// So at least one side sees the other's store:
//  - the waiter sees the new bell: it does not sleep;
//  - the ringer sees sleeping == 1: it calls FUTEX_WAKE. If the waiter is
//    already queued, it is woken. If not, its FUTEX_WAIT(bell, v) compares
//    *bell with v under the futex hash-bucket lock, which the kernel orders
//    after the ringer's store (that store precedes the ringer's FUTEX_WAKE;
//    futex(2) makes the check-and-queue atomic with respect to wake), so
//    FUTEX_WAIT returns EAGAIN at once.
// (The textbook form is a release store plus atomic_thread_fence(seq_cst) on
// each side; GCC's ThreadSanitizer rejects fences, and on x86 a seq_cst
// store is one XCHG, cheaper than MOV + MFENCE, so the fence-free form costs
// nothing.) The seq_cst store/load of the bell are also release/acquire, so
// the data written before Ring() (a request or a result) is visible to the
// waiter that returns the new value. `sleeping` itself carries no data.
//
// The futex ops are the shared (not _PRIVATE) ones: the word lives in a
// MAP_SHARED mapping used by two processes, and private futexes are keyed on
// the caller's own mm, so a wake from the other process would never arrive.

namespace dos {
namespace {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  alignof(std::atomic<uint32_t>) == alignof(uint32_t),
              "the futex syscall reads the atomic's storage as a plain u32");

using Clock = std::chrono::steady_clock;

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

std::chrono::nanoseconds ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

Clock::time_point DeadlineAfter(absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return Clock::time_point::max();
  // Clamped so that now + timeout cannot overflow; ~31 years is forever.
  constexpr int64_t kMaxNs = 1'000'000'000'000'000'000;
  const int64_t ns = std::clamp<int64_t>(absl::ToInt64Nanoseconds(timeout), 0, kMaxNs);
  return Clock::now() + std::chrono::nanoseconds(ns);
}

}  // namespace

void Doorbell::Ring(uint32_t seq) {
  bell_->store(seq, std::memory_order_seq_cst);
  if (sleeping_->load(std::memory_order_seq_cst) != 0) {
    // INT_MAX rather than 1: costs nothing with the single waiter the
    // contract allows, and does not strand a second one if it is broken.
    Futex(bell_, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

template <typename Done>
uint32_t Doorbell::Wait(Done done, absl::Duration timeout) {
  uint32_t v = bell_->load(std::memory_order_acquire);
  if (done(v) || timeout <= absl::ZeroDuration()) return v;
  const Clock::time_point deadline = DeadlineAfter(timeout);

  // 1. Spin: a reply within microseconds costs no system call on either side.
  //    The clock is read once per batch of pauses to keep the poll tight.
  const Clock::time_point start = Clock::now();
  const Clock::time_point spin_end = std::min(deadline, start + ToChrono(kSpin));
  const Clock::time_point yield_end = std::min(deadline, start + ToChrono(kSpin + kYieldSpin));
  do {
    for (int i = 0; i < 64; ++i) {
      CpuRelax();
      v = bell_->load(std::memory_order_acquire);
      if (done(v)) return v;
    }
  } while (Clock::now() < spin_end);

  // 2. Poll with sched_yield: if the peer is runnable on our CPU (both
  //    processes on one core: oversubscribed node, small CI machine), pure
  //    spinning would hold it off for our whole window on every hand-off;
  //    yielding lets it run at once. With nothing else runnable, sched_yield
  //    returns immediately and this is still a poll.
  do {
    sched_yield();
    v = bell_->load(std::memory_order_acquire);
    if (done(v)) return v;
  } while (Clock::now() < yield_end);

  // 3. Sleep in FUTEX_WAIT on the value we last saw, in slices ending at the
  //    deadline. Every return (woken, EAGAIN, EINTR, ETIMEDOUT, spurious)
  //    re-reads the bell.
  for (;;) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return v;
    sleeping_->store(1, std::memory_order_seq_cst);
    v = bell_->load(std::memory_order_seq_cst);
    if (!done(v)) {
      timespec ts{};
      const timespec* tsp = nullptr;
      if (deadline != Clock::time_point::max()) {
        const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
        ts.tv_sec = static_cast<time_t>(left.count() / 1'000'000'000);
        ts.tv_nsec = static_cast<long>(left.count() % 1'000'000'000);
        tsp = &ts;
      }
      Futex(bell_, FUTEX_WAIT, v, tsp);
      v = bell_->load(std::memory_order_acquire);
    }
    sleeping_->store(0, std::memory_order_relaxed);
    if (done(v)) return v;
  }
}

uint32_t Doorbell::WaitChange(uint32_t last_seen, absl::Duration timeout) {
  return Wait([last_seen](uint32_t v) { return v != last_seen; }, timeout);
}

bool Doorbell::WaitFor(uint32_t seq, absl::Duration timeout) {
  return Wait([seq](uint32_t v) { return v == seq; }, timeout) == seq;
}

void FutexWaitShared(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const int64_t ns = absl::ToInt64Nanoseconds(std::min(timeout, absl::Hours(24)));
  const timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  Futex(word, FUTEX_WAIT, expected, &ts);
}

void FutexWakeShared(std::atomic<uint32_t>* word) { Futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

}  // namespace dos
