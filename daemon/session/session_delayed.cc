// Session's delayed host path (daemon/sched/delayed_host.h; the protocol in
// dos/wire/control_block.h): the DelayedHost of the session's shard, the
// trainer's window between steps, the update that runs after a delayed
// step's result (HandleRequest, still under the step lock, or handed off to
// the next step: AwaitHandOff) and the installs of pending weights before
// anything else writes them.
#include <algorithm>
#include <optional>

#include "daemon/session/session.h"

namespace dos {

DelayedHost* Session::DelayedFor(StepKind kind) {
  if (delayed_ == nullptr && (kind.delays_host() || kind.finishes_delayed())) {
    // Its buffers count against --host_memory_limit and the session's
    // --session_memory_limit with the shard's state.
    delayed_ = std::make_unique<DelayedHost>(*shard_, budget_, options_.memory_limit);
  }
  return delayed_.get();
}

void Session::NoteWindow(const StepRequest& request) {
  if (delayed_ == nullptr || request.ring_ns <= last_post_ns_ || last_post_ns_ == 0) return;
  // An early step rings during backward: its window ends at its verdict
  // (AddDelayFigures).
  if (request.flags & kStepGradientsPending) return;
  // The host's view (the trainer rang after its forward and backward): what
  // engines that measure on the GPU replace (AddDelayFigures).
  delayed_->NoteWindowSample(static_cast<double>(request.ring_ns - last_post_ns_) * 1e-3);
}

void Session::AddDelayFigures(const StepRequest& request, StepOutcome* out) {
  if (delayed_ == nullptr) return;
  if (out->early && last_post_ns_ != 0 && delayed_->verdict_ns > last_post_ns_) {
    // An early step's window: from the last result to its verdict (the GPU
    // and the ring see only its begin, during backward).
    out->measured_window_us = static_cast<double>(delayed_->verdict_ns - last_post_ns_) * 1e-3;
  }
  // The GPU's view, for the next plan.
  if (out->measured_window_us > 0) delayed_->NoteWindowSample(out->measured_window_us);
  // The update of this step's captures runs beside the next window.
  delayed_->window_loaded = out->delayed_subgroups > 0;
  out->delayed_update_us = delayed_->update_us;
  if (out->measured_window_us > 0) {
    out->delayed_wait_us = std::max(0.0, -out->delayed_slack_us);
  } else if (request.ring_ns != 0 && delayed_->update_end_ns > request.ring_ns) {
    out->delayed_wait_us = static_cast<double>(delayed_->update_end_ns - request.ring_ns) * 1e-3;
  }
}

void Session::RunDelayedUpdate() {
  if (delayed_ == nullptr || delayed_->captured().empty()) return;
  // Joined here, not handed off (its delayed.update line says so).
  delayed_->handed_off = false;
  executor_->FinishUpdate(*shard_, *delayed_, identity_.id);
}

std::optional<Session::NextStep> Session::AwaitHandOff(uint32_t seq) {
  if (delayed_ != nullptr && delayed_->update_in_flight() && executor_->delayed_handoff()) {
    auto* block = static_cast<ControlBlock*>(control_->data());
    while (!delayed_->update_finished() && !stop_.load(std::memory_order_acquire) &&
           others_waiting_.load(std::memory_order_relaxed) == 0) {
      // The trainer's ring wakes this at once; the update's end within 200 us.
      const uint32_t next = channel_->WaitRequest(seq, absl::Microseconds(200));
      if (next == seq) continue;
      const StepRequest request = block->request;  // published by request_bell (acquire)
      const absl::StatusOr<StepKind> kind = StepKind::Decode(request.flags, false);
      if (kind.ok() && kind->early() && kind->delays_host() && trainer_gate_.TryBeginEarlyStep()) {
        delayed_->handed_off = true;
        ClearResult(&block->result);
        return NextStep{next, request};
      }
      break;  // the step loop reads it again after the update
    }
  }
  RunDelayedUpdate();
  return std::nullopt;
}

absl::Status Session::InstallPendingWeights() {
  if (delayed_ == nullptr) return absl::OkStatus();
  return executor_->InstallPending(*shard_, bindings_, *delayed_);
}

}  // namespace dos
