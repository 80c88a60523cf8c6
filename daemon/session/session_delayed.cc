// Session's delayed host path (daemon/sched/delayed_host.h; the protocol in
// dos/wire/control_block.h): the DelayedHost of the session's shard, the
// trainer's window between steps, the update that runs after a delayed
// step's result (HandleRequest, still under the step lock) and the installs
// of pending weights before anything else writes them.
#include <algorithm>

#include "daemon/common/log.h"
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

void Session::RunDelayedUpdate(bool early) {
  if (delayed_ == nullptr || delayed_->captured().empty()) return;
  const uint64_t last_end_ns = delayed_->update_end_ns;
  absl::Status st = executor_->UpdateDelayed(*shard_, *delayed_);
  if (!st.ok()) {
    DOS_LOG_ERROR("step.delayed_update_failed", "session", identity_.id, "error", st.message());
    return;
  }
  // When the update ran against the verdict and the last update: the host
  // path idles from the last update's end to this one's start (a verdict
  // read late, the step's scan and first copies).
  const double start_ns = static_cast<double>(delayed_->update_end_ns) - delayed_->update_us * 1e3;
  DOS_LOG_DEBUG("delayed.update", "session", identity_.id, "update_us", delayed_->update_us,
                "start_after_verdict_us",
                early && delayed_->verdict_ns != 0
                    ? (start_ns - static_cast<double>(delayed_->verdict_ns)) * 1e-3
                    : 0.0,
                "idle_before_us",
                last_end_ns != 0 ? (start_ns - static_cast<double>(last_end_ns)) * 1e-3 : 0.0,
                "kernel_us", delayed_->kernel_us, "kernel_params", delayed_->kernel_params);
}

absl::Status Session::InstallPendingWeights() {
  if (delayed_ == nullptr) return absl::OkStatus();
  return executor_->InstallPending(*shard_, bindings_, *delayed_);
}

}  // namespace dos
