// DaemonCounters: daemon-lifetime totals that every session's step thread
// adds to after each step, read by the metrics endpoint (main.cc registers
// them as Prometheus counters). Unlike per-session statistics they do not go
// backwards when a session detaches.
//
// Thread-safety: relaxed atomics; each field is independent.
#pragma once

#include <atomic>
#include <cstdint>

namespace dos {

struct DaemonCounters {
  std::atomic<uint64_t> steps{0};           // steps answered OK (skipped included)
  std::atomic<uint64_t> skipped_steps{0};   // non-finite gradients: nothing applied
  std::atomic<uint64_t> failed_steps{0};    // answered with an error
  std::atomic<uint64_t> params_updated{0};  // parameters updated by applied steps
  std::atomic<uint64_t> cpu_params{0};      // of which on the CPU (GPU mode split)
  std::atomic<uint64_t> gpu_params{0};      // of which on the GPU
  std::atomic<uint64_t> h2d_bytes{0};       // PCIe bytes, host to device
  std::atomic<uint64_t> d2h_bytes{0};       // PCIe bytes, device to host
  std::atomic<uint64_t> update_us{0};       // time spent in updates
  std::atomic<uint64_t> lock_wait_us{0};    // steps waiting for the session lock
  std::atomic<uint64_t> snapshot_wait_us{0};  // steps copying subgroups for a snapshot
};

}  // namespace dos
