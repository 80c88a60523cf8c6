#include "daemon/sched/early_capture.h"

#include <algorithm>
#include <chrono>

#include "dos/wire/status_macros.h"

namespace dos {

EarlyCapture::EarlyCapture(Engine* engine, const ShardState& shard,
                           std::span<const TensorBinding> bindings,
                           std::span<const uint32_t> subgroups, const StepSync& sync,
                           DelayedHost* delayed, bool gradients)
    : engine_(engine),
      shard_(shard),
      bindings_(bindings),
      subgroups_(subgroups.begin(), subgroups.end()),
      sync_(sync),
      delayed_(delayed),
      gradients_(gradients) {
  delayed_->DropEarly();
  if (subgroups_.empty() || !sync_.is_ready) {
    joined_ = true;
    if (sync_.captures_done) sync_.captures_done();
    return;
  }
  thread_ = std::thread([this] {
    Loop();
    // No more copies before the verdict: a trainer waiting to scale its
    // gradients in place may go on.
    if (sync_.captures_done) sync_.captures_done();
  });
}

void EarlyCapture::Loop() {
  // Backward makes a subgroup's gradients in milliseconds: polls from 50 us,
  // backing off to 1 ms while nothing is ready (the ready words of a GPU
  // trainer are written by its stream, which wakes no one).
  // One subgroup a copy, and none once the verdict came: what is left goes
  // with the step's own copies after it, which install on one copy engine
  // while they capture on the other (measured on nvidia-h200 at 6B, 1.9B
  // parameters delayed: a step that came late to its verdict spent 70 ms
  // installing here, then 72 ms capturing after it).
  // Any ready subgroup, the first ready in plan order: a subgroup the order
  // puts early but backward (or a handed-off update) frees late holds up
  // none of the others (the GPU's share comes last in the plan's list, and
  // a hand-off's update frees its subgroups in its own order).
  auto nap = std::chrono::microseconds(50);
  std::vector<uint32_t> left = subgroups_;
  while (!left.empty() && !stop_.load(std::memory_order_acquire) &&
         !(sync_.capture_stopped && sync_.capture_stopped())) {
    // Ready: backward is done with it, and an update handed off to this
    // step (DelayedHost, "a hand-off") with its buffers.
    const auto ready = std::find_if(left.begin(), left.end(), [this](uint32_t sg) {
      return sync_.is_ready(sg) && delayed_->update_done(sg);
    });
    if (ready != left.end()) {
      // The trainer may have stopped the captures since the check above and
      // gone on without waiting for us: asked again after saying a copy
      // begins (sync.capture_begins).
      if (sync_.capture_begins && !sync_.capture_begins()) return;
      status_ = CopyRun(std::span<const uint32_t>(&*ready, 1));
      if (sync_.capture_ended) sync_.capture_ended();
      if (!status_.ok()) return;
      left.erase(ready);
      copied_.fetch_add(1, std::memory_order_release);
      nap = std::chrono::microseconds(50);
      continue;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(1));
  }
}

absl::Status EarlyCapture::CopyRun(std::span<const uint32_t> run) {
  if (gradients_) {
    delayed_->BeginEarly(run);
    DOS_RETURN_IF_ERROR(engine_->CaptureDelayed(shard_, bindings_, *delayed_, run));
    delayed_->EarlyCaptured(run);
    return absl::OkStatus();
  }
  // The weights alone: the step's capture after the verdict copies the
  // gradients and installs nothing twice (DelayedHost::Installed).
  std::vector<uint32_t> pending;
  for (uint32_t sg : run) {
    if (delayed_->installable(sg)) pending.push_back(sg);
  }
  if (pending.empty()) return absl::OkStatus();
  DOS_RETURN_IF_ERROR(engine_->InstallDelayed(shard_, bindings_, *delayed_, pending));
  delayed_->Installed(pending);
  return absl::OkStatus();
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
