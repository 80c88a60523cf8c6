// A doorbell: one 32-bit futex word in shared memory that carries a sequence
// number from a ringer to a waiter in another process.
//
// Ring(seq) publishes seq with release ordering and wakes the waiter only if
// it announced that it sleeps (the `sleeping` flag beside the bell), so a
// round trip between two busy processes makes no system call. Wait* spins
// for a short, bounded time (the common case of a reply within microseconds),
// then sleeps in FUTEX_WAIT (shared, not private: the word is in a
// MAP_SHARED mapping) with a timeout so the caller can check liveness and
// shutdown.
//
// Thread-safety: one ringer and one waiter per bell.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace dos {

class Doorbell {
 public:
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
  std::atomic<uint32_t>* bell_;
  std::atomic<uint32_t>* sleeping_;
};

}  // namespace dos
