// Session's step result in the control block (dos/wire/control_block.h
// StepResult): cleared when a request is read, filled from the outcome.
#include <algorithm>
#include <cstring>

#include "daemon/common/log.h"
#include "daemon/session/session.h"

namespace dos {
namespace {

void PostError(ControlBlock* block, const absl::Status& status) {
  block->result.status_code = static_cast<int32_t>(status.code());
  absl::string_view msg = status.message();
  size_t n = std::min(msg.size(), static_cast<size_t>(kMaxStatusMessage - 1));
  std::memcpy(block->result.message, msg.data(), n);
  block->result.message[n] = '\0';
}

}  // namespace

void Session::ClearResult(StepResult* result) {
  result->status_code = 0;
  result->found_inf = 0;
  result->early = 0;
  result->before_verdict_us = 0;
  result->after_verdict_us = 0;
  result->prefetched_bytes = 0;
  result->delayed_subgroups = 0;
  result->delayed_params = 0;
  result->delayed_update_us = 0;
  result->delayed_wait_us = 0;
  result->window_us = 0;
  result->predicted_update_us = 0;
  result->predicted_iter_us = 0;
  result->message[0] = '\0';
}

void Session::PostOutcome(ControlBlock* block, const absl::StatusOr<StepOutcome>& outcome,
                          double wall_us) {
  StepResult& result = block->result;
  if (outcome.ok()) {
    result.found_inf = outcome->found_inf ? 1 : 0;
    result.step = outcome->step;
    result.update_us = outcome->update_us;
    result.early = outcome->early ? 1 : 0;
    result.before_verdict_us = outcome->before_verdict_us;
    result.after_verdict_us = outcome->after_verdict_us;
    result.prefetched_bytes = outcome->prefetched_bytes;
    result.delayed_subgroups = outcome->delayed_subgroups;
    result.delayed_params = outcome->delayed_params;
    result.delayed_update_us = outcome->delayed_update_us;
    result.delayed_wait_us = outcome->delayed_wait_us;
    result.window_us = outcome->window_us;
    result.predicted_update_us = outcome->predicted_us;
    result.predicted_iter_us = outcome->predicted_iter_us;
  } else {
    PostError(block, outcome.status());
    DOS_LOG_WARNING("step.failed", "session", identity_.id, "error", outcome.status().message());
  }
  result.wall_us = wall_us;
}

}  // namespace dos
