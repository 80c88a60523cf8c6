#include "daemon/sched/early_capture.h"

#include <algorithm>
#include <chrono>

namespace dos {

EarlyCapture::EarlyCapture(Engine* engine, const ShardState& shard,
                           std::span<const TensorBinding> bindings,
                           std::span<const uint32_t> subgroups, const StepSync& sync,
                           DelayedHost* delayed)
    : engine_(engine),
      shard_(shard),
      bindings_(bindings),
      subgroups_(subgroups.begin(), subgroups.end()),
      sync_(sync),
      delayed_(delayed) {
  delayed_->DropEarly();
  if (subgroups_.empty() || !sync_.is_ready) {
    joined_ = true;
    return;
  }
  thread_ = std::thread([this] { Loop(); });
}

void EarlyCapture::Loop() {
  // Backward makes a subgroup's gradients in milliseconds: polls from 50 us,
  // backing off to 1 ms while nothing is ready (the ready words of a GPU
  // trainer are written by its stream, which wakes no one).
  auto nap = std::chrono::microseconds(50);
  size_t next = 0;
  while (next < subgroups_.size()) {
    size_t end = next;
    while (end < subgroups_.size() && sync_.is_ready(subgroups_[end])) ++end;
    if (end > next) {
      const std::span<const uint32_t> run(subgroups_.data() + next, end - next);
      delayed_->BeginEarly(run);
      status_ = engine_->CaptureDelayed(shard_, bindings_, *delayed_, run);
      if (!status_.ok()) return;
      delayed_->EarlyCaptured(run);
      next = end;
      nap = std::chrono::microseconds(50);
      continue;
    }
    if (stop_.load(std::memory_order_acquire)) return;
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(1));
  }
}

absl::Status EarlyCapture::Stop() {
  if (joined_) return status_;
  stop_.store(true, std::memory_order_release);
  thread_.join();
  joined_ = true;
  if (!status_.ok()) delayed_->DropEarly();
  return status_;
}

}  // namespace dos
