#include "daemon/state/register_progress.h"

#include <time.h>

namespace dos {

uint64_t RegisterProgress::NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

void RegisterProgress::BeginPhase(RegisterPhase phase, uint64_t total_bytes) {
  const uint64_t now = NowNs();
  const bool first = phase_.load(std::memory_order_relaxed) == kRegisterIdle;
  if (first) start_ns_.store(now, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  total_.store(total_bytes, std::memory_order_relaxed);
  phase_start_ns_.store(now, std::memory_order_relaxed);
  phase_.store(phase, std::memory_order_release);
  if (mirror_ != nullptr) {
    mirror_->bytes_done.store(0, std::memory_order_relaxed);
    mirror_->bytes_total.store(total_bytes, std::memory_order_relaxed);
    mirror_->phase_start_ns.store(now, std::memory_order_relaxed);
    if (first) mirror_->start_ns.store(now, std::memory_order_relaxed);
    mirror_->phase.store(phase, std::memory_order_release);
  }
}

void RegisterProgress::Add(uint64_t bytes) {
  const uint64_t done = done_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (mirror_ != nullptr) mirror_->bytes_done.store(done, std::memory_order_relaxed);
}

void RegisterProgress::Finish() {
  phase_.store(kRegisterIdle, std::memory_order_release);
  if (mirror_ != nullptr) mirror_->phase.store(kRegisterIdle, std::memory_order_release);
}

RegisterProgress::View RegisterProgress::Read() const {
  View v;
  v.phase = static_cast<RegisterPhase>(phase_.load(std::memory_order_acquire));
  if (v.phase == kRegisterIdle) return v;
  v.bytes_done = done_.load(std::memory_order_relaxed);
  v.bytes_total = total_.load(std::memory_order_relaxed);
  const uint64_t now = NowNs();
  v.phase_seconds = (now - phase_start_ns_.load(std::memory_order_relaxed)) * 1e-9;
  v.total_seconds = (now - start_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return v;
}

}  // namespace dos
