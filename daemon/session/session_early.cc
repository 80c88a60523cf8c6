// Session's early steps (protocol 5, dos/wire/control_block.h): the step's
// synchronisation with the trainer and the waits for its ready words and its
// verdict, each bounded by the trainer's liveness and by
// SessionOptions::early_ready_timeout from the step's begin.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/session/session.h"
#include "dos/wire/status_macros.h"

namespace dos {

StepSync Session::MakeStepSync(uint32_t seq, StepKind kind, absl::Time begun) const {
  StepSync sync;
  sync.trainer_event = trainer_event_;
  sync.subgroup_done = [this, seq](uint32_t subgroup) {
    channel_->MarkSubgroupDone(subgroup, seq);
  };
  sync.wait_ready = [this, seq, begun, stream_written = kind.stream_ordered()](uint32_t subgroup) {
    return WaitReady(subgroup, seq, begun, stream_written);
  };
  sync.is_ready = [this, seq](uint32_t subgroup) {
    return channel_->SubgroupReady(subgroup, seq);
  };
  sync.capture_stopped = [this, seq] { return channel_->CaptureStopped(seq); };
  sync.capture_begins = [this, seq] { return channel_->BeginCapture(seq); };
  sync.capture_ended = [this] { channel_->EndCapture(); };
  sync.captures_done = [this, seq] { channel_->MarkCapturesDone(seq); };
  sync.stream_coef = [this] { return channel_->StreamCoef(); };
  sync.late_skip = [this, seq](StepRequest* late) {
    if (!channel_->WaitVerdict(seq, absl::ZeroDuration())) return false;
    const auto* block = static_cast<const ControlBlock*>(control_->data());
    *late = block->verdict;  // published by verdict_bell (acquire)
    return true;
  };
  return sync;
}

absl::Status Session::EarlyStepAlive(const char* waiting_for) const {
  if (stop_.load(std::memory_order_acquire)) {
    return absl::UnavailableError(absl::StrCat("step: the session is closing while it waited for ",
                                               waiting_for, "; nothing more was applied"));
  }
  if (!ClientAlive()) {
    return absl::UnavailableError(absl::StrCat("step: the trainer (pid ", identity_.pid,
                                               ") is gone while dosd waited for ", waiting_for,
                                               "; nothing more was applied"));
  }
  return absl::OkStatus();
}

absl::Status Session::WaitReady(uint32_t subgroup, uint32_t seq, absl::Time begun,
                               bool stream_written) const {
  // Waiting costs nothing. On the CPU path the trainer's library wakes the
  // word's futex after its store (ControlBlockChannel::MarkReady), so the
  // wait sleeps a liveness slice at a time. In GPU mode the trainer's stream
  // writes the word (cuStreamWriteValue32) and nothing wakes a futex: the
  // wait sleeps in FUTEX_WAIT with a timeout that doubles from 50 us to 1 ms
  // (backward makes a subgroup's gradients in milliseconds), and to 10 ms
  // once it has waited a second (a stalled trainer then costs 100 wake-ups a
  // second, not a core). Liveness and the deadline are checked per slice.
  if (channel_->SubgroupReady(subgroup, seq)) return absl::OkStatus();
  const absl::Time wait_start = absl::Now();
  absl::Duration nap =
      stream_written ? absl::Microseconds(50) : ControlBlockChannel::kLivenessSlice;
  absl::Time next_check = wait_start + ControlBlockChannel::kLivenessSlice;
  while (!channel_->WaitSubgroupReady(subgroup, seq, nap)) {
    const absl::Time now = absl::Now();
    if (stream_written) {
      const absl::Duration cap =
          now - wait_start < absl::Seconds(1) ? absl::Milliseconds(1) : absl::Milliseconds(10);
      nap = std::min(nap * 2, cap);
    }
    if (now < next_check) continue;
    DOS_RETURN_IF_ERROR(EarlyStepAlive("gradients"));
    if (now - begun > options_.early_ready_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step: the gradients of subgroup ", subgroup, " were not marked ready within ",
          absl::FormatDuration(options_.early_ready_timeout), " of early step ", seq,
          "'s begin (trainer pid ", identity_.pid, "); dosd stopped waiting so that the "
          "other trainers on its engine go on. Subgroups updated before are one update "
          "ahead (resume= continues from there). A backward that long needs dosd "
          "--early_step_ready_timeout raised, or overlap=True/False instead of \"update\""));
    }
    next_check = now + ControlBlockChannel::kLivenessSlice;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepRequest> Session::AwaitVerdict(uint32_t seq, absl::Time begun) const {
  auto* block = static_cast<ControlBlock*>(control_->data());
  while (!channel_->WaitVerdict(seq, ControlBlockChannel::kLivenessSlice)) {
    // The bell only moves forward to seq (cyclically): past it, no verdict
    // for this step will ever come.
    const uint32_t bell = block->verdict_bell.load(std::memory_order_acquire);
    if (static_cast<int32_t>(bell - seq) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step: verdict_bell was rung for seq ", bell, " while early step ", seq,
          " awaits its verdict; ring it with the step's seq (dos_step_verdict does)"));
    }
    DOS_RETURN_IF_ERROR(EarlyStepAlive("the step's verdict"));
    if (absl::Now() - begun > options_.early_ready_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step: no verdict for early step ", seq, " within ",
          absl::FormatDuration(options_.early_ready_timeout), " of its begin (trainer pid ",
          identity_.pid, "); nothing was applied. Call dos_step_verdict or dos_step_abandon "
          "after backward, or raise dosd --early_step_ready_timeout"));
    }
  }
  StepRequest verdict = block->verdict;  // published by verdict_bell (acquire)
  if (verdict.seq != seq) {
    return absl::InvalidArgumentError(absl::StrCat("step: the verdict carries seq ", verdict.seq,
                                                   " for early step ", seq));
  }
  return verdict;
}

}  // namespace dos
