// StepExecutor's part for the delayed host path (daemon/sched/delayed_host.h)
// and for early steps' verdicts: the installs of pending weights, the
// delayed update's run and join, and the wait for a verdict while the
// delayed subgroups' gradients are captured (early_capture.h). The rest of
// the step is in step_executor.cc.
#include <cmath>
#include <optional>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/sched/early_capture.h"
#include "daemon/sched/step_executor.h"
#include "dos/wire/status_macros.h"

namespace dos {

absl::Status StepExecutor::InstallPending(const ShardState& shard,
                                          std::span<const TensorBinding> bindings,
                                          DelayedHost& delayed) {
  if (delayed.pending().empty()) return absl::OkStatus();
  const std::vector<uint32_t> all = delayed.pending();
  DOS_RETURN_IF_ERROR(engine_->InstallDelayed(shard, bindings, delayed, all));
  delayed.Installed(all);
  return absl::OkStatus();
}

DelayedHost::Run StepExecutor::RunDelayedKernel(ShardState& shard, const DelayedHost& delayed) {
  const absl::Time start = absl::Now();
  // The CPU's rate: its own parameters over its kernel's time (not the
  // wall time: the update may wait for the step's last captures, and the
  // GPU's share runs beside it).
  uint64_t params = 0;
  for (uint32_t sg : delayed.captured()) {
    if (!delayed.updates_on_gpu(sg)) params += shard.subgroups()[sg].numel;
  }
  DelayedHost::Run run;
  run.status = engine_->UpdateDelayed(shard, delayed, &run.kernel_us);
  run.us = absl::ToDoubleMicroseconds(absl::Now() - start);
  run.end_ns = MonotonicNs();
  run.kernel_params = params;
  if (run.status.ok()) planner_.LearnDelayed(params, run.kernel_us);
  return run;
}

absl::Status StepExecutor::UpdateDelayed(ShardState& shard, DelayedHost& delayed, uint64_t session,
                                         bool keep_early) {
  if (delayed.captured().empty()) return absl::OkStatus();
  DelayedHost::Run run;
  if (delayed.worker.joinable()) {
    delayed.worker.join();
    run = delayed.worker_run;
  } else {
    run = RunDelayedKernel(shard, delayed);
  }
  const uint64_t last_end_ns = delayed.update_end_ns;
  delayed.update_us = run.us;
  delayed.update_end_ns = run.end_ns;
  delayed.kernel_us = run.kernel_us;
  delayed.kernel_params = run.kernel_params;
  const absl::Status st = run.status;
  // Whatever happened, these subgroups' weights are what the buffers hold
  // now; a failed kernel (none can fail but a bad plan) is the step's error.
  delayed.Updated(keep_early);
  if (!st.ok()) return st;
  // When the update ran against its step's verdict and the last update: the
  // host path idles from the last update's end to this one's start (a
  // verdict read late, the step's scan and first copies).
  const double start_ns = static_cast<double>(run.end_ns) - run.us * 1e3;
  const uint64_t verdict_ns = delayed.update_verdict_ns;
  DOS_LOG_DEBUG("delayed.update", "session", session, "update_us", run.us, "start_after_verdict_us",
                verdict_ns != 0 ? (start_ns - static_cast<double>(verdict_ns)) * 1e-3 : 0.0,
                "idle_before_us",
                last_end_ns != 0 ? (start_ns - static_cast<double>(last_end_ns)) * 1e-3 : 0.0,
                "kernel_us", run.kernel_us, "kernel_params", run.kernel_params, "handed_off",
                delayed.handed_off ? "true" : "false", "start_after_handoff_join_us",
                delayed.handoff_joined_ns != 0
                    ? (start_ns - static_cast<double>(delayed.handoff_joined_ns)) * 1e-3
                    : 0.0);
  return absl::OkStatus();
}

void StepExecutor::FinishUpdate(ShardState& shard, DelayedHost& delayed, uint64_t session,
                                bool keep_early) {
  const absl::Status st = UpdateDelayed(shard, delayed, session, keep_early);
  if (!st.ok()) {
    DOS_LOG_ERROR("step.delayed_update_failed", "session", session, "error", st.message());
  }
}

void StepExecutor::JoinHandOff(ShardState& shard, DelayedHost* delayed, uint64_t session,
                               bool keep_early) {
  if (delayed == nullptr || !delayed->handed_off) return;
  const uint64_t begin_ns = MonotonicNs();
  FinishUpdate(shard, *delayed, session, keep_early);  // logs as handed off
  delayed->handed_off = false;
  delayed->handoff_joined_ns = MonotonicNs();
  delayed->handoff_join_us = static_cast<double>(delayed->handoff_joined_ns - begin_ns) * 1e-3;
}

absl::StatusOr<StepRequest> StepExecutor::AwaitVerdictCapturing(
    const StepPlan& plan, ShardState& shard, std::span<const TensorBinding> bindings, StepKind kind,
    const StepSync& sync, const AwaitVerdict& await_verdict, DelayedHost* delayed,
    uint64_t session) {
  // A delayed step copies its delayed subgroups as backward finishes each
  // (early_capture.h). Buffers it cannot place now are placed (or refused,
  // with the step's error) after the verdict, as for any delayed step.
  // After a verdict that rewrote the gradients, only the weights.
  const bool copy_gradients = delayed != nullptr && !delayed->gradients_rewritten;
  std::optional<EarlyCapture> early;
  if (kind.delays_host() && delayed != nullptr && !plan.delayed.empty() &&
      delayed->Place(plan.delayed, [this](uint64_t bytes) { return engine_->AllocStaging(bytes); })
          .ok()) {
    early.emplace(engine_, shard, bindings, plan.delayed, sync, delayed, copy_gradients);
  } else if (sync.captures_done) {
    sync.captures_done();  // nothing is copied before this verdict
  }
  absl::StatusOr<StepRequest> request = AwaitFinalRequest(shard, await_verdict);
  std::optional<float> scaled;
  if (delayed != nullptr) {
    // When the trainer gave the verdict (its ring, protocol 8's clients;
    // else now): the window must not grow by the time this thread came late
    // to it (it may have been finishing the previous delayed update, which
    // would feed the update's own length back into its budget).
    const uint64_t now = MonotonicNs();
    const uint64_t rung = request.ok() ? request->ring_ns : 0;
    delayed->verdict_ns = rung != 0 && rung <= now ? rung : now;
    if (request.ok()) {
      delayed->gradients_rewritten = (request->flags & kStepGradientsRewritten) != 0;
      scaled = ScaledCoef(*request, shard, sync.capture_stopped && sync.capture_stopped());
      delayed->SetEarlyCoef(scaled.value_or(1.0f));
    }
  }
  if (!early.has_value()) {
    JoinHandOff(shard, delayed, session, false);  // nothing was captured beside it
    return request;
  }
  // How late this thread read the verdict, then how long the captures still
  // running took to join (measured apart: the join must not count as late).
  const double read_late_us = static_cast<double>(MonotonicNs() - delayed->verdict_ns) * 1e-3;
  const absl::Time stop_start = absl::Now();
  const absl::Status copied = early->Stop();
  DOS_LOG_DEBUG("step.early_capture", "verdict_read_late_us", read_late_us, "join_us",
                absl::ToDoubleMicroseconds(absl::Now() - stop_start), "copied_subgroups",
                early->copied(), "of", plan.delayed.size(), "copied_gradients", copy_gradients,
                "rewritten", delayed->gradients_rewritten, "scaled_by", delayed->early_coef());
  if (!copied.ok()) {
    DOS_LOG_WARNING(
        "step.early_capture_failed", "error", copied.message(), "then",
        copy_gradients
            ? "the step copies the gradients after its verdict"
            : "the step installs the pending weights with the gradients after its verdict");
  }
  // Gradients written after their ready marks are copied again (scaled
  // ones only where ScaledCoef cannot keep them); those of a step given up
  // are never read.
  // The captures have stopped: a handed-off update is joined, leaving the
  // subgroups they installed installed and their gradients captured.
  JoinHandOff(shard, delayed, session, true);
  if (!request.ok() || (request->flags & kStepGradientsRewritten) ||
      ((request->flags & kStepGradientsScaled) && !scaled.has_value())) {
    delayed->DropEarly();
  }
  return request;
}

std::optional<float> StepExecutor::ScaledCoef(const StepRequest& verdict, const ShardState& shard,
                                              bool stopped) {
  // A trainer that did not stop the captures may have scaled some while
  // they were being copied.
  if (!(verdict.flags & kStepGradientsScaled) || (verdict.flags & kStepGradientsRewritten) ||
      !stopped) {
    return std::nullopt;
  }
  // The update first computes round_to(grad dtype, float(g) * c) (the
  // kernels' grad_coef), bit for bit the trainer's multiply of fp32 or bf16
  // gradients by the coefficient (torch computes it in fp32 and rounds to
  // nearest even). fp16 gradients, or a step that also unscales or clips
  // (torch's GradScaler would have written them again), are copied again.
  if (verdict.grad_scale != 1.0 || verdict.clip_coef != 1.0) return std::nullopt;
  for (const TensorDesc& t : shard.tensors()) {
    if (t.grad_dtype != DType::kF32 && t.grad_dtype != DType::kBF16) return std::nullopt;
  }
  return verdict.gradient_coef;
}

bool StepExecutor::ResolveStreamCoef(float coef, DelayedHost* delayed) {
  const bool scale = std::isfinite(coef) && coef >= 0;
  if (delayed == nullptr) return scale;
  if (scale) {
    delayed->SetEarlyCoef(coef);  // no effect where the captures were dropped already
  } else {
    delayed->DropEarly();
    delayed->gradients_rewritten = true;
  }
  return scale;
}

absl::StatusOr<StepRequest> StepExecutor::AwaitFinalRequest(const ShardState& shard,
                                                            const AwaitVerdict& await_verdict) {
  DOS_ASSIGN_OR_RETURN(StepRequest request, await_verdict());
  DOS_RETURN_IF_ERROR(CheckStepFlags(request.flags, "verdict"));
  if (request.flags & kStepAbandon) {
    return absl::AbortedError(
        "step: the trainer abandoned the early step before its verdict; nothing was applied");
  }
  DOS_RETURN_IF_ERROR(ValidateStepRequest(request, shard.groups().size()));
  return request;
}

}  // namespace dos
