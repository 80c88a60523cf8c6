// ClientSession's steps over the control block (dos/wire/control_block.h):
// begin (synchronous, on a stream, early), ready marks, the verdict, the
// result, and the per-subgroup waits. Which calls a step takes is its
// phase in the session's StepMachine (step_machine.h).
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "dos/wire/status_macros.h"
#include "request_builder.h"
#include "session.h"

namespace dos::client {
namespace {

// CLOCK_MONOTONIC now (StepRequest::ring_ns).
uint64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

absl::Status ClientSession::StepBeginOnStream(const dos_step_args& args, void* stream) {
  if (device_sync_ == nullptr) {
    return absl::FailedPreconditionError(
        "step_begin_on_stream: this session has no stream synchronisation (its tensors are in "
        "shared memory, or the CUDA driver lacks stream memory operations); synchronise the "
        "stream and call dos_step_begin");
  }
  DOS_RETURN_IF_ERROR(CheckBegin());
  DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
  return Publish(args, kStepTrainerEventRecorded, StepEvent::kBegin);
}

absl::Status ClientSession::WaitSubgroups(uint32_t first, uint32_t last, void* stream,
                                          absl::Duration timeout) {
  if (!registered_) {
    return absl::FailedPreconditionError(
        "wait_subgroups: no tensors registered; call dos_register first");
  }
  if (first > last || last >= num_subgroups_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "wait_subgroups: range [", first, ", ", last, "] is not within the session's ",
        num_subgroups_, " subgroups (dos_tensor_subgroups gives a tensor's range)"));
  }
  if (!step_.in_flight()) return absl::OkStatus();  // the last step's result was taken
  if (stream != nullptr && device_sync_ != nullptr) {
    // One wait per word; subgroups from kMaxTrackedSubgroups - 1 on share one.
    const uint32_t end = std::min(last, kMaxTrackedSubgroups - 1);
    for (uint32_t i = first; i <= end; ++i) {
      DOS_RETURN_IF_ERROR(device_sync_->StreamWait(stream, step_channel_->DoneWord(i), seq_));
    }
    return absl::OkStatus();
  }
  absl::Status st = step_channel_->WaitSubgroups(first, last, seq_, timeout);
  if (st.ok() && abandoned_.load(std::memory_order_acquire)) {
    return absl::UnavailableError(absl::StrCat(
        "wait_subgroups: step ", seq_, " was abandoned: dosd (pid ", control_->daemon_pid,
        ") closed the session or is gone; restart it and attach again"));
  }
  return st;
}

absl::Status ClientSession::TensorSubgroups(uint32_t tensor, uint32_t* first,
                                            uint32_t* last) const {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "tensor_subgroups"));
  if (tensor >= tensor_subgroups_.size()) {
    return absl::FailedPreconditionError(
        "tensor_subgroups: the daemon did not report its layout (an older dosd)");
  }
  *first = tensor_subgroups_[tensor].first;
  *last = tensor_subgroups_[tensor].second;
  return absl::OkStatus();
}

absl::Status ClientSession::SetStepDelay(uint32_t delay) {
  if (delay > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "set_step_delay: delay ", delay, " is not supported; 0 (exact) or 1 (one step late)"));
  }
  delay_ = delay;
  return absl::OkStatus();
}

absl::Status ClientSession::GradientsRewritten() {
  if (!step_.awaiting_gradients()) {
    return absl::FailedPreconditionError(
        "step_gradients_rewritten: no early step awaits its verdict; begin one with "
        "dos_step_begin_early");
  }
  rewritten_ = true;
  return absl::OkStatus();
}

absl::Status ClientSession::StopCaptures(void* stream, absl::Duration timeout) {
  // (The request the step was published with: delayed as it began.)
  if (!step_.awaiting_gradients() || step_.without_verdict() ||
      !(control_->request.flags & kStepDelayHost)) {
    return absl::FailedPreconditionError(
        "step_stop_captures: no early step of a delayed session awaits its verdict; begin one "
        "with dos_step_begin_early after dos_set_step_delay(1)");
  }
  step_channel_->StopCaptures(seq_);
  stopped_ = true;
  // No copy of this step begun: dosd sees the stop before it begins one
  // (control_block.h, protocol 10), also while it still updates the step
  // before. Otherwise it stores capture_done once the copy in flight is
  // complete: the trainer's stream waits for that (its CPU thread goes on);
  // on the CPU path this does.
  if (!step_channel_->CaptureInFlight(seq_)) return absl::OkStatus();
  if (device_sync_ != nullptr && stream != nullptr) {
    return device_sync_->StreamWait(stream, step_channel_->CaptureDoneWord(), seq_);
  }
  return step_channel_->WaitCapturesDone(seq_, timeout);
}

absl::Status ClientSession::CheckStopped(absl::string_view call) const {
  if (stopped_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(call,
                   ": the captures of the early step in flight were not stopped; call "
                   "dos_step_stop_captures before scaling the gradients in place"));
}

absl::Status ClientSession::GradientsScaled(float coef) {
  DOS_RETURN_IF_ERROR(CheckStopped("step_gradients_scaled"));
  if (!std::isfinite(coef) || coef < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_gradients_scaled: coefficient ", coef,
        " is invalid; it must be finite and >= 0 (use dos_step_gradients_rewritten for any "
        "other write)"));
  }
  scaled_ = coef;
  return absl::OkStatus();
}

absl::Status ClientSession::GradientsScaledOnStream(const void* device_coef, void* stream) {
  DOS_RETURN_IF_ERROR(CheckStopped("step_gradients_scaled_on_stream"));
  // (A null stream is CUDA's legacy default stream.)
  if (device_sync_ == nullptr || device_coef == nullptr) {
    return absl::FailedPreconditionError(
        "step_gradients_scaled_on_stream: needs GPU mode with stream memory operations and a "
        "device pointer; use dos_step_gradients_scaled with the coefficient read on the host");
  }
  DOS_RETURN_IF_ERROR(device_sync_->CopyToBlock(stream, step_channel_->StreamCoefWord(),
                                                device_coef, sizeof(float)));
  scaled_ = 1.0f;  // the verdict's placeholder: dosd reads the block's copy
  scaled_on_stream_ = true;
  return absl::OkStatus();
}

absl::Status ClientSession::FinishDelayed(void* stream, absl::Duration timeout) {
  DOS_RETURN_IF_ERROR(CheckBegin());
  if (control_->closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError(
        "step_finish_delayed: the daemon closed this session (shutdown or detach)");
  }
  StepRequest& r = control_->request;
  r.flags = kStepFinishDelayed;
  r.num_groups = static_cast<uint32_t>(num_groups_);
  r.grad_scale = 1;
  r.clip_coef = 1;
  r.ring_ns = 0;  // not the end of a forward and backward
  if (device_sync_ != nullptr && stream != nullptr) {
    DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
    r.flags |= kStepTrainerEventRecorded;
  }
  r.seq = control_->request_bell.load(std::memory_order_relaxed) + 1;
  seq_ = step_channel_->PublishRequest();
  DOS_RETURN_IF_ERROR(step_.Go(StepEvent::kBegin));
  inflight_seq_.store(seq_, std::memory_order_release);
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { WatchSteps(); });
  finishing_ = true;
  return StepWait(timeout, nullptr);
}

absl::Status ClientSession::CheckBegin() const {
  if (!registered_) {
    return absl::FailedPreconditionError("step: no tensors registered; call dos_register first");
  }
  if (step_.in_flight()) {
    return absl::FailedPreconditionError(
        "step: a step is already in flight; call dos_step_wait before beginning another");
  }
  return absl::OkStatus();
}

absl::Status ClientSession::StepBegin(const dos_step_args& args) {
  DOS_RETURN_IF_ERROR(CheckBegin());
  return Publish(args, BeginFlags(StepEvent::kBegin), StepEvent::kBegin);
}

absl::Status ClientSession::Publish(const dos_step_args& args, uint32_t extra_flags,
                                    StepEvent begin) {
  if (control_->closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError("step: the daemon closed this session (shutdown or detach)");
  }
  if (delay_ != 0 && begin == StepEvent::kBeginEarlyWithoutVerdict) {
    return absl::InvalidArgumentError(
        "step: a delayed session (dos_set_step_delay) cannot begin an early step without a "
        "verdict (DOS_EARLY_NO_VERDICT updates during backward already); set the delay to 0 "
        "or begin the step with a verdict");
  }
  StepRequest& r = control_->request;
  DOS_RETURN_IF_ERROR(FillStepRequest(args, num_groups_, tensors_.size(), &r));
  r.flags |= extra_flags;
  if (delay_ != 0) r.flags |= kStepDelayHost;
  r.ring_ns = MonotonicNs();
  bool lease_lowered = false;
  if (lease_set_) {
    r.flags |= kStepGpuLease;
    r.gpu_lease_bytes = lease_.lease_bytes;
    r.gpu_budget_bytes = lease_.budget_bytes;
    r.gpu_peak_bytes = lease_.peak_bytes;
    lease_lowered = !lease_sent_ || lease_.lease_bytes < lease_sent_bytes_;
    lease_sent_ = true;
    lease_sent_bytes_ = lease_.lease_bytes;
  }
  r.seq = control_->request_bell.load(std::memory_order_relaxed) + 1;
  seq_ = step_channel_->PublishRequest();
  DOS_RETURN_IF_ERROR(step_.Go(begin));
  inflight_seq_.store(seq_, std::memory_order_release);
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { WatchSteps(); });
  if (lease_lowered) {
    // dosd gives the memory back before this step's update; the trainer may
    // allocate it as soon as we return. A daemon that closed the session or
    // died is reported by StepWait, as for any step.
    absl::Status applied = step_channel_->WaitLeaseApplied(seq_, absl::InfiniteDuration());
    if (!applied.ok()) lease_sent_ = false;  // tell the next step's dosd again
  }
  return absl::OkStatus();
}

absl::Status ClientSession::StepBeginEarly(const dos_step_args& args, uint32_t flags,
                                           void* stream) {
  if (flags & ~static_cast<uint32_t>(DOS_EARLY_NO_VERDICT)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_begin_early: unknown flags ", flags, "; pass 0 or DOS_EARLY_NO_VERDICT"));
  }
  DOS_RETURN_IF_ERROR(CheckBegin());
  const StepEvent begin = (flags & DOS_EARLY_NO_VERDICT) != 0
                              ? StepEvent::kBeginEarlyWithoutVerdict
                              : StepEvent::kBeginEarly;
  uint32_t extra = BeginFlags(begin);
  if (device_sync_ != nullptr) {
    // Orders the daemon's streams after what the trainer queued so far (the
    // last step's zero_grad, this backward's beginning); each subgroup's
    // gradients are then announced by its ready word.
    DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
    extra |= kStepTrainerEventRecorded;
  }
  ready_marked_.assign(num_subgroups_, 0);
  tail_unmarked_ = num_subgroups_ >= kMaxTrackedSubgroups ? num_subgroups_ - (kMaxTrackedSubgroups - 1)
                                                          : 0;
  return Publish(args, extra, begin);
}

absl::Status ClientSession::MarkOne(uint32_t i, void* stream) {
  if (ready_marked_[i]) return absl::OkStatus();
  ready_marked_[i] = 1;
  if (i >= kMaxTrackedSubgroups - 1 && --tail_unmarked_ != 0) return absl::OkStatus();
  // GPU mode: stream-ordered; dosd cannot be woken by the stream's write and
  // polls the word with a bounded backoff. Otherwise a store that wakes it.
  if (device_sync_ != nullptr) {
    return device_sync_->StreamWrite(stream, step_channel_->ReadyWord(i), seq_);
  }
  step_channel_->MarkReady(i, seq_);
  return absl::OkStatus();
}

absl::Status ClientSession::MarkReady(uint32_t first, uint32_t last, void* stream) {
  if (!step_.awaiting_gradients()) {
    return absl::FailedPreconditionError(
        "mark_ready: no early step awaits gradients; begin one with dos_step_begin_early");
  }
  if (first > last || last >= num_subgroups_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mark_ready: range [", first, ", ", last, "] is not within the session's ",
        num_subgroups_, " subgroups (dos_tensor_subgroups gives a tensor's range)"));
  }
  for (uint32_t i = first; i <= last; ++i) DOS_RETURN_IF_ERROR(MarkOne(i, stream));
  return absl::OkStatus();
}

absl::Status ClientSession::StepVerdict(const dos_step_args* args, void* stream) {
  if (!step_.awaiting_gradients()) {
    return absl::FailedPreconditionError(
        "step_verdict: no early step awaits its verdict; begin one with dos_step_begin_early");
  }
  const bool no_verdict = step_.without_verdict();
  if (args == nullptr && no_verdict) {
    return absl::FailedPreconditionError(
        "step_abandon: an early step without a verdict (DOS_EARLY_NO_VERDICT) cannot be "
        "abandoned: dosd applies its subgroups as they become ready; call dos_step_verdict");
  }
  if (no_verdict) {
    // Tensors without a gradient (their subgroups were never announced, so
    // dosd has not updated them): published before those subgroups are
    // announced, so dosd reads the mask before it updates them.
    StepRequest late{};
    DOS_RETURN_IF_ERROR(FillSkipMask(*args, tensors_.size(), &late));
    if (late.flags != 0) {
      StepRequest& v = control_->verdict;
      v = late;
      v.seq = seq_;
      step_channel_->PublishVerdict(seq_);
    }
  }
  // Every subgroup not announced yet is final now (unused parameters, a
  // gradient replaced outside autograd's hooks): announced after the work
  // queued so far.
  for (uint32_t i = 0; i < num_subgroups_; ++i) DOS_RETURN_IF_ERROR(MarkOne(i, stream));
  if (!no_verdict) {
    StepRequest& v = control_->verdict;
    if (args == nullptr) {
      v = StepRequest{};
      v.flags = kStepAbandon;
    } else {
      DOS_RETURN_IF_ERROR(FillStepRequest(*args, num_groups_, tensors_.size(), &v));
      if (rewritten_) v.flags |= kStepGradientsRewritten;
      if (scaled_.has_value() && !rewritten_) {
        v.flags |= kStepGradientsScaled;
        v.gradient_coef = *scaled_;
        if (scaled_on_stream_) v.flags |= kStepGradientsScaledOnStream;
      }
      v.ring_ns = MonotonicNs();  // the end of this forward and backward (a delay's window)
      if (device_sync_ != nullptr) {
        // Whatever the trainer did to the gradients after backward (an
        // in-place clip, a copy into the registered buffer) comes before
        // dosd reads them.
        DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
        v.flags |= kStepTrainerEventRecorded;
      }
    }
    v.seq = seq_;
    step_channel_->PublishVerdict(seq_);
  }
  rewritten_ = false;
  stopped_ = false;
  scaled_.reset();
  scaled_on_stream_ = false;
  return step_.Go(args == nullptr ? StepEvent::kAbandon : StepEvent::kVerdict);
}

absl::Status ClientSession::StepWait(absl::Duration timeout, dos_step_result* result) {
  if (!step_.in_flight()) {
    return absl::FailedPreconditionError("step_wait: no step in flight; call dos_step_begin");
  }
  if (step_.awaiting_gradients()) {
    return absl::FailedPreconditionError(
        "step_wait: the early step in flight has no verdict yet (dosd waits for it); call "
        "dos_step_verdict or dos_step_abandon first");
  }
  absl::Status waited = step_channel_->WaitResult(seq_, timeout);
  const bool finish = finishing_;  // a FinishDelayed is no step: the last step's figures stay
  if (!absl::IsDeadlineExceeded(waited)) {
    inflight_seq_.store(0, std::memory_order_release);
    finishing_ = false;
  }
  if (absl::IsDeadlineExceeded(waited)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "step_wait: step ", seq_, " not finished after ", absl::FormatDuration(timeout),
        "; it is still in flight, call dos_step_wait again"));
  }
  if (!waited.ok()) {
    // The daemon will not finish this step: release anything (the trainer's
    // stream included) still waiting on its subgroups.
    step_channel_->MarkAllDone(seq_, num_subgroups_);
    DOS_RETURN_IF_ERROR(step_.Go(StepEvent::kLose));
    return absl::Status(waited.code(), absl::StrCat("step_wait: ", waited.message(),
                                                    "; re-attach to continue"));
  }
  DOS_RETURN_IF_ERROR(step_.Go(StepEvent::kCollect));
  const StepResult& res = control_->result;  // published by done_bell (acquire)
  if (!finish) {
    last_early_ = static_cast<int32_t>(res.early);
    last_before_verdict_us_ = res.before_verdict_us;
    last_after_verdict_us_ = res.after_verdict_us;
    last_prefetched_bytes_ = res.prefetched_bytes;
    last_delay_ = DelayFigures{res.delayed_subgroups, res.delayed_params,
                               res.delayed_update_us, res.delayed_wait_us,
                               res.window_us, res.predicted_update_us,
                               res.predicted_iter_us};
  }
  if (res.seq != seq_) {
    return absl::InternalError(absl::StrCat("step_wait: result seq ", res.seq,
                                            " does not match request seq ", seq_));
  }
  if (res.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(res.status_code),
                        absl::StrCat("step: ", std::string(res.message, strnlen(res.message,
                                                                               kMaxStatusMessage))));
  }
  if (result != nullptr) {
    result->found_inf = res.found_inf != 0;
    result->step = res.step;
    result->wall_us = res.wall_us;
    result->update_us = res.update_us;
  }
  return absl::OkStatus();
}

}  // namespace dos::client
