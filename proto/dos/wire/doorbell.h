// A doorbell: one 32-bit futex word in shared memory that carries a sequence
// number from a ringer to a waiter in another process.
//
// Ring(seq) publishes seq (a seq_cst store, so also a release) and wakes the
// waiter only if it announced that it sleeps (the `sleeping` flag beside the
// bell), so a round trip between two busy processes makes no system call.
// Why no wake-up is lost is argued in doorbell.cc.
//
// Wait* first spins briefly (the common case of a reply within microseconds),
// then polls with sched_yield for a while (so a peer that shares our CPU runs
// at once instead of after our whole spin window), then sleeps in FUTEX_WAIT
// (shared, not private: the word is in a MAP_SHARED mapping, and private
// futexes key on the process's own address space) with a timeout so the
// caller can check liveness and shutdown. A value seen by Wait* is acquired:
// everything the ringer wrote before Ring() is visible to the waiter after
// Wait* returns it.
//
// Ownership: the Doorbell is a view; it owns neither word.
// Thread-safety: one ringer and one waiter per bell (the `sleeping` flag is
// the single waiter's announcement). Both may be in different processes.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace dos {

class Doorbell {
 public:
  // How long a waiter polls before it sleeps: kSpin with pause instructions,
  // then kYieldSpin with sched_yield. A step's reply either comes within
  // microseconds (the empty or small step) or after milliseconds of work;
  // polling much longer than a futex wake-up costs buys nothing in the
  // second case. Measured on a 2-vCPU VM (bench/doorbell): a pure 30 us spin
  // made every hand-off between two processes sharing a CPU cost 2 x 30 us;
  // yielding after 5 us cut the wake-from-sleep median from ~69 to ~20 us.
  static constexpr absl::Duration kSpin = absl::Microseconds(5);
  static constexpr absl::Duration kYieldSpin = absl::Microseconds(25);

  // Both words must outlive the Doorbell and live in shared memory.
  Doorbell(std::atomic<uint32_t>* bell, std::atomic<uint32_t>* sleeping)
      : bell_(bell), sleeping_(sleeping) {}

  void Ring(uint32_t seq);

  // Waits until the bell's value differs from `last_seen` or `timeout`
  // passes. Returns the value seen (== last_seen on timeout).
  uint32_t WaitChange(uint32_t last_seen, absl::Duration timeout);
  // Waits until the bell equals `seq` or `timeout` passes. Returns true if it
  // does.
  bool WaitFor(uint32_t seq, absl::Duration timeout);

  uint32_t Load() const { return bell_->load(std::memory_order_acquire); }

 private:
  // Waits until done(bell value) or the timeout; returns the last value read.
  template <typename Done>
  uint32_t Wait(Done done, absl::Duration timeout);

  std::atomic<uint32_t>* bell_;
  std::atomic<uint32_t>* sleeping_;
};

// A shared futex on a word that is not a Doorbell (no `sleeping` flag): sleeps
// while *word == expected, up to `timeout` (woken, a changed value, a signal
// or the timeout all return; the caller re-reads the word).
void FutexWaitShared(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// Wakes every waiter on `word` (a system call, whether anyone sleeps or not).
void FutexWakeShared(std::atomic<uint32_t>* word);

}  // namespace dos
