// RegisterProgress: how far the registration of one shard has got, published
// while RegisterShard runs (allocating and first-touching the state, reading
// the trainer's weights into the masters, page-locking it for the GPU path),
// so that `dosctl sessions` and the trainer's log can show it: a 6B shard is
// about 71 GB of state.
//
// The registering thread calls BeginPhase / Finish; any thread (the workers
// touching or pinning chunks) calls Add; readers call Read from any thread.
// When constructed over a control block's RegisterProgressWords, every change
// is mirrored there (relaxed stores; the words are advisory) so the trainer
// reads it without a call into the daemon.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

#include "dos/wire/control_block.h"

namespace dos {

class RegisterProgress {
 public:
  // `mirror` may be null; it must outlive this object when given.
  explicit RegisterProgress(RegisterProgressWords* mirror = nullptr) : mirror_(mirror) {}

  // Starts `phase` with `total_bytes` to go; resets the byte count.
  void BeginPhase(RegisterPhase phase, uint64_t total_bytes);
  // `bytes` more of the current phase are done.
  void Add(uint64_t bytes);
  // The registration ended (successfully or not): phase kRegisterIdle.
  void Finish();

  struct View {
    RegisterPhase phase = kRegisterIdle;
    uint64_t bytes_done = 0;
    uint64_t bytes_total = 0;
    double phase_seconds = 0;  // since the phase began
    double total_seconds = 0;  // since the first phase began
  };
  View Read() const;

  // CLOCK_MONOTONIC in nanoseconds (the clock of RegisterProgressWords).
  static uint64_t NowNs();

 private:
  RegisterProgressWords* const mirror_;
  std::atomic<uint32_t> phase_{kRegisterIdle};
  std::atomic<uint64_t> done_{0};
  std::atomic<uint64_t> total_{0};
  std::atomic<uint64_t> phase_start_ns_{0};
  std::atomic<uint64_t> start_ns_{0};
};

}  // namespace dos
