#include "daemon/sched/step_executor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/cpu/adam_kernel.h"
#include "dos/wire/hparams.h"
#include "dos/wire/status_macros.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_for.h"

namespace dos {
namespace {

// Converts `n` weights in `dtype` at `src` to fp32, in parallel chunks (a
// 6B-parameter shard converts 6e9 elements at registration and after every
// state load).
void WeightsToFloat(const char* src, DType dtype, uint64_t n, float* out) {
  tbb::parallel_for(tbb::blocked_range<uint64_t>(0, n, uint64_t{1} << 20),
                    [&](const tbb::blocked_range<uint64_t>& r) {
    for (uint64_t e = r.begin(); e < r.end(); ++e) {
      uint16_t h;
      switch (dtype) {
        case DType::kF32: std::memcpy(&out[e], src + 4 * e, 4); break;
        case DType::kBF16: std::memcpy(&h, src + 2 * e, 2); out[e] = BF16ToFloat(h); break;
        case DType::kF16: std::memcpy(&h, src + 2 * e, 2); out[e] = F16ToFloat(h); break;
      }
    }
  });
}

void FloatToWeights(const float* in, uint64_t n, DType dtype, char* out) {
  tbb::parallel_for(tbb::blocked_range<uint64_t>(0, n, uint64_t{1} << 20),
                    [&](const tbb::blocked_range<uint64_t>& r) {
    for (uint64_t i = r.begin(); i < r.end(); ++i) {
      switch (dtype) {
        case DType::kF32: reinterpret_cast<float*>(out)[i] = in[i]; break;
        case DType::kBF16: reinterpret_cast<uint16_t*>(out)[i] = FloatToBF16(in[i]); break;
        case DType::kF16: reinterpret_cast<uint16_t*>(out)[i] = FloatToF16(in[i]); break;
      }
    }
  });
}

// The scalars depend on the tensor's group and step count only: computed
// once per tensor, not per run.
std::vector<cpu::AdamScalars> Scalars(const ShardState& shard, const StepRequest& request) {
  std::vector<cpu::AdamScalars> scalars;
  scalars.reserve(shard.tensors().size());
  uint32_t i = 0;
  for (const TensorDesc& t : shard.tensors()) {
    if (SkipsTensor(request, i++)) {
      scalars.push_back(cpu::KeepAdamScalars());  // no gradient: unchanged
      continue;
    }
    const GroupConfig& group = shard.groups()[t.group];
    scalars.push_back(cpu::MakeAdamScalars(request.groups[t.group], group.decoupled_weight_decay,
                                           t.step + 1, request.grad_scale, request.clip_coef));
  }
  return scalars;
}

// Steps updated per subgroup (StepKind::per_subgroup): the tensors the
// trainer found without a gradient at step() (StepSync::late_skip) keep
// their state, as torch skips them. The subgroups holding them become ready
// only after the trainer published them, so applying them when an engine
// first sees a subgroup ready after that is in time, and the scalars it
// changes belong to no subgroup an engine reads meanwhile. EngineSync()
// gives the engine readiness checks that apply them; the request's mask
// then also keeps their step counts. Anything else published in the verdict
// slot of such a step (another seq, other flags: an abandon) is ignored, as
// it always was, and logged: failing the step there would leave it half
// applied.
class LateSkip {
 public:
  LateSkip(const StepSync& sync, uint32_t seq, size_t num_tensors, StepRequest* request,
           std::vector<cpu::AdamScalars>* scalars)
      : sync_(sync), seq_(seq), num_tensors_(num_tensors), request_(request),
        scalars_(scalars) {}

  // The trainer's synchronisation with readiness checks that apply the late
  // mask first; `sync` itself when none can come.
  StepSync EngineSync() {
    StepSync run = sync_;
    if (!sync_.late_skip) return run;
    run.wait_ready = [this, wait = sync_.wait_ready](uint32_t sg) -> absl::Status {
      DOS_RETURN_IF_ERROR(wait(sg));
      Apply();
      return absl::OkStatus();
    };
    run.is_ready = [this, ready = sync_.is_ready](uint32_t sg) {
      if (!ready(sg)) return false;
      Apply();
      return true;
    };
    return run;
  }

 private:
  void Apply() {
    absl::MutexLock lock(&mu_);
    StepRequest late;
    if (applied_ || !sync_.late_skip(&late)) return;
    applied_ = true;
    if (late.seq != seq_ || late.flags != kStepSkipTensors) {
      DOS_LOG_WARNING("step.late_verdict_ignored", "seq", seq_, "published_seq", late.seq,
                      "flags", late.flags, "reason",
                      "a step without a verdict takes only the tensors without a gradient "
                      "(kStepSkipTensors alone) after its begin");
      return;
    }
    std::memcpy(request_->skip, late.skip, sizeof(request_->skip));
    request_->flags |= kStepSkipTensors;
    for (uint32_t i = 0; i < num_tensors_; ++i) {
      if (SkipsTensor(*request_, i)) (*scalars_)[i] = cpu::KeepAdamScalars();
    }
  }

  const StepSync& sync_;
  const uint32_t seq_;
  const size_t num_tensors_;
  StepRequest* const request_;
  std::vector<cpu::AdamScalars>* const scalars_;
  absl::Mutex mu_;
  bool applied_ ABSL_GUARDED_BY(mu_) = false;
};

// Optimizer steps applied so far: the largest tensor count (a tensor
// without a gradient in some steps, kStepSkipTensors, counts fewer).
int64_t StepCount(std::span<const TensorDesc> tensors) {
  int64_t n = 0;
  for (const TensorDesc& t : tensors) n = std::max(n, t.step);
  return n;
}

// What a step of `kind` needs from its caller to wait for its trainer.
absl::Status CheckWaits(StepKind kind, const StepSync& sync, const AwaitVerdict& await_verdict) {
  if (kind.per_subgroup() && (!sync.wait_ready || !sync.is_ready)) {
    return absl::InternalError("step: an early step without a verdict needs the ready words");
  }
  if (kind.awaits_verdict() && !await_verdict) {
    return absl::InternalError("step: an early step needs a way to await its verdict");
  }
  return absl::OkStatus();
}

// An early step's figures: from `start` (the request) to `verdict_at`
// (`start` for steps without one) and from there to now.
void TimeEarly(StepKind kind, absl::Time start, absl::Time verdict_at, StepOutcome* out) {
  if (!kind.early()) return;
  out->early = true;
  out->before_verdict_us = absl::ToDoubleMicroseconds(verdict_at - start);
  out->after_verdict_us = absl::ToDoubleMicroseconds(absl::Now() - verdict_at);
}

}  // namespace

absl::Status ValidateStepRequest(const StepRequest& r, size_t num_groups) {
  if (r.num_groups != num_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: request carries ", r.num_groups, " param groups but ", num_groups,
                     " were registered; send hyperparameters for every registered group"));
  }
  if (!std::isfinite(r.grad_scale) || r.grad_scale <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: grad_scale = ", r.grad_scale, " is invalid; it must be finite and > 0 (1 = none)"));
  }
  if (!std::isfinite(r.clip_coef) || r.clip_coef < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: clip_coef = ", r.clip_coef, " is invalid; it must be finite and >= 0 (1 = none)"));
  }
  if ((r.flags & kStepGradientsScaled) &&
      (!std::isfinite(r.gradient_coef) || r.gradient_coef < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: the verdict says the gradients were scaled in place by gradient_coef = ",
        r.gradient_coef,
        ", which is invalid; it must be finite and >= 0 (send "
        "kStepGradientsRewritten instead for anything else)"));
  }
  constexpr uint32_t kOnStreamNeeds = kStepGradientsScaled | kStepTrainerEventRecorded;
  if ((r.flags & kStepGradientsScaledOnStream) && (r.flags & kOnStreamNeeds) != kOnStreamNeeds) {
    return absl::InvalidArgumentError(
        "step: the verdict says the gradients' coefficient comes through the trainer's stream "
        "(kStepGradientsScaledOnStream) without kStepGradientsScaled and "
        "kStepTrainerEventRecorded beside it; set both (the coefficient is read after the "
        "trainer's event)");
  }
  for (size_t i = 0; i < num_groups; ++i) {
    absl::Status st = ValidateGroupStepParams(r.groups[i], i, "step");
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

PlannerOptions StepExecutor::WithEngine(PlannerOptions options, const Engine& engine) {
  options.budgets.gpu = engine.has_gpu();
  return options;
}

StepExecutor::StepExecutor(Engine* engine, PlannerOptions planner)
    : engine_(engine), planner_(WithEngine(std::move(planner), *engine)) {}

StepOutcome StepExecutor::Outcome(const StepPlan& plan, const StepMeasurements& m) const {
  StepOutcome out;
  for (const TimelineEntry& e : m.entries) {
    if (e.path == 'r') ++out.resident_subgroups;
    if (e.path == 'g') ++out.gpu_subgroups;
    if (e.path == 'c' || e.path == 'd') ++out.cpu_subgroups;
  }
  if (!engine_->has_gpu()) return out;
  out.cpu_params = m.cpu_params;
  out.gpu_params = m.gpu_params;
  out.h2d_bytes = m.gpu_h2d_bytes + m.cpu_h2d_bytes + m.prefetched_bytes;
  out.prefetched_bytes = m.prefetched_bytes;
  out.d2h_bytes = m.gpu_d2h_bytes + m.cpu_d2h_bytes;
  out.cpu_busy_us = m.cpu_kernel_us;
  out.gpu_busy_us = m.gpu_kernel_us;
  out.h2d_busy_us = m.h2d_us;
  out.d2h_busy_us = m.d2h_us;
  out.predicted_us = plan.predicted_us;
  out.model_gpu_share = plan.gpu_share;
  out.model_binding = plan.binding;
  out.node_share = plan.node_share;
  out.gpu_memory_bytes = m.gpu_memory_bytes;
  return out;
}

absl::StatusOr<StepOutcome> StepExecutor::Run(ShardState& shard,
                                              std::span<const TensorBinding> bindings,
                                              const StepRequest& request, const Policy& policy,
                                              const StepSync& sync, uint64_t session) {
  return Run(shard, bindings, request, StepKind(), policy, sync, session, {});
}

absl::StatusOr<StepOutcome> StepExecutor::Run(ShardState& shard,
                                              std::span<const TensorBinding> bindings,
                                              const StepRequest& begun, StepKind kind,
                                              const Policy& policy, const StepSync& sync,
                                              uint64_t session,
                                              const AwaitVerdict& await_verdict,
                                              DelayedHost* delayed) {
  const absl::Time start = absl::Now();
  DOS_RETURN_IF_ERROR(CheckWaits(kind, sync, await_verdict));
  if ((kind.delays_host() || kind.finishes_delayed()) && delayed == nullptr) {
    return absl::InternalError("step: a delayed step needs the session's delayed host path");
  }
  // A hand-off (the session left the last delayed update running): only an
  // early delayed step begins beside it, and it joins the update at its
  // verdict; however this step ends, it is joined before Run returns.
  absl::Cleanup handed = [&] { JoinHandOff(shard, delayed, session, false); };
  if (delayed != nullptr) delayed->handoff_join_us = 0;
  if (!kind.awaits_verdict() || !kind.delays_host()) JoinHandOff(shard, delayed, session, false);
  if (kind.finishes_delayed()) {
    DOS_RETURN_IF_ERROR(WaitForTrainerEvent(begun, sync, SharesEngine(session)));
    DOS_RETURN_IF_ERROR(InstallPending(shard, bindings, *delayed));
    StepOutcome out;
    out.step = StepCount(shard.tensors());
    out.update_us = absl::ToDoubleMicroseconds(absl::Now() - start);
    return out;
  }
  if (!kind.awaits_verdict()) {
    DOS_RETURN_IF_ERROR(ValidateStepRequest(begun, shard.groups().size()));
  }
  // The plan and the resident tier depend on no gradient: made before the
  // verdict, so that the engine can start moving the first streamed
  // subgroups' state while backward still runs (the scan below waits for it).
  const ShardLayout layout = planner_.LayoutOf(shard);
  DOS_ASSIGN_OR_RETURN(const uint32_t resident,
                       ResidentFor(shard, layout, policy, session, kind, delayed));
  // The node counts this engine as stepping (its share of the host) from
  // here until the step ends, failed or skipped included.
  NodeResources::Step node_step = planner_.BeginStep(layout, resident);
  const double window_us = delayed != nullptr ? delayed->PlanWindowUs() : 0;
  const StepPlan plan = planner_.Plan(policy, layout, resident, kind, window_us);
  // The plan may stream only state the update does not write. A hand-off's
  // step prefetches nothing: the update's GPU share holds the slots.
  if (delayed != nullptr && delayed->handed_off && !delayed->UpdateStaysIn(plan.delayed)) {
    JoinHandOff(shard, delayed, session, false);
  }
  if (delayed == nullptr || !delayed->handed_off) {
    DOS_RETURN_IF_ERROR(engine_->Prefetch(plan, shard));
  }
  StepRequest request = begun;
  absl::Time verdict_at = start;
  if (kind.awaits_verdict()) {
    DOS_ASSIGN_OR_RETURN(request, AwaitVerdictCapturing(plan, shard, bindings, kind, sync,
                                                        await_verdict, delayed, session));
    verdict_at = absl::Now();
  }
  // The host waits for the event where dosd reads what the trainer's stream
  // wrote before it (the scan, the stream's coefficient: GradientsFinite) or
  // where another session shares the engine; alone and with gradients the
  // trainer checked, only the engine's streams wait (its work is queued
  // before the event completes).
  const bool reads_after_event =
      !(request.flags & kStepGradientsChecked) || (request.flags & kStepGradientsScaledOnStream);
  DOS_RETURN_IF_ERROR(
      WaitForTrainerEvent(request, sync, reads_after_event || SharesEngine(session)));
  const absl::Time event_at = absl::Now();
  StepOutcome out;
  DOS_ASSIGN_OR_RETURN(const bool finite, GradientsFinite(request, shard, bindings, sync, delayed));
  if (finite && kind.per_subgroup() && engine_->has_gpu() && SharesEngine(session)) {
    // BindSession: on a shared GPU the gradients are waited for here, not
    // inside the engine.
    for (uint32_t sg = 0; sg < shard.subgroups().size(); ++sg) {
      DOS_RETURN_IF_ERROR(sync.wait_ready(sg));
    }
  }
  const absl::Time checked_at = absl::Now();
  if (finite) {
    DOS_ASSIGN_OR_RETURN(out, Apply(plan, shard, bindings, kind, sync, &request, &node_step,
                                    delayed));
    AddLease(session, &out);
  } else {
    out.found_inf = true;
    if (delayed != nullptr) {
      delayed->DropEarly();  // gradients of a step that applies nothing
      DOS_RETURN_IF_ERROR(InstallPending(shard, bindings, *delayed));
    }
  }
  out.window_us = plan.window_us;
  out.predicted_iter_us = plan.predicted_iter_us;
  out.step = StepCount(shard.tensors());
  out.update_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  TimeEarly(kind, start, verdict_at, &out);
  // Where a step's time went, for an operator chasing a slow step.
  DOS_LOG_DEBUG("step.phases", "to_verdict_us", absl::ToDoubleMicroseconds(verdict_at - start),
                "handoff_join_us", delayed != nullptr ? delayed->handoff_join_us : 0.0,
                "trainer_event_us", absl::ToDoubleMicroseconds(event_at - verdict_at),
                "finite_scan_us", absl::ToDoubleMicroseconds(checked_at - event_at), "apply_us",
                absl::ToDoubleMicroseconds(absl::Now() - checked_at), "delayed",
                plan.delayed.size(), "delayed_gpu", plan.delayed_gpu.size(), "streamed",
                plan.gpu_only.size() + plan.shared.size(), "window_us", plan.window_us,
                "predicted_us", plan.predicted_us, "host_slowdown", plan.host_slowdown,
                "m_host_gbps", plan.inputs.host_bytes_per_s * 1e-9, "m_host_shared_gbps",
                plan.inputs.host_shared_bytes_per_s * 1e-9);
  return out;
}

absl::StatusOr<uint32_t> StepExecutor::ResidentFor(ShardState& shard, const ShardLayout& layout,
                                                   const Policy& policy, uint64_t session,
                                                   StepKind kind, DelayedHost* delayed) {
  if (session == 0) return StepPlanner::ResidentCount(policy, layout, planner_.budgets());
  uint32_t target = planner_.ResidentTarget(policy, layout, session);
  if (kind.delays_host() && delayed != nullptr) {
    // The host may take the tail the window covers, resident or not, when
    // the model predicts a shorter update for it (the delayed subgroups'
    // copies cross PCIe where resident ones only cost GPU kernel time); the
    // cap moves by more than a twentieth of the subgroups (at least 2) only,
    // so that a window's jitter does not move state in and out of the GPU.
    const double window_us = delayed->PlanWindowUs();
    uint32_t cap = planner_.DelayedResidentCap(policy, layout, window_us);
    if (cap < target && planner_.Plan(policy, layout, cap, kind, window_us).predicted_us >=
                            planner_.Plan(policy, layout, target, kind, window_us).predicted_us) {
      cap = target;
    }
    const int64_t jitter =
        std::max<int64_t>(2, static_cast<int64_t>(layout.subgroup_numel.size()) / 20);
    if (delayed->resident_cap < 0 ||
        std::abs(static_cast<int64_t>(cap) - delayed->resident_cap) > jitter) {
      delayed->resident_cap = static_cast<int64_t>(cap);
    }
    target = std::min<uint32_t>(target, static_cast<uint32_t>(delayed->resident_cap));
  }
  // A handed-off update writes its subgroups' host state: none of them may
  // become resident beside it.
  if (delayed != nullptr && delayed->handed_off) {
    // The tier as the handed-off update's step left it: nothing to move.
    if (target == delayed->update_resident) return target;
    if (!delayed->UpdateAbove(target)) JoinHandOff(shard, delayed, session, false);
  }
  return engine_->SetResident(shard, target, true);
}

absl::StatusOr<bool> StepExecutor::GradientsFinite(const StepRequest& request,
                                                   const ShardState& shard,
                                                   std::span<const TensorBinding> bindings,
                                                   const StepSync& sync, DelayedHost* delayed) {
  const bool checked = (request.flags & kStepGradientsChecked) != 0;
  const bool on_stream = (request.flags & kStepGradientsScaledOnStream) != 0;
  if (checked && !on_stream) return true;
  // The scan and the stream's coefficient come after the trainer's event:
  // WaitForTrainerEvent waited for it on the host (Run asks it to here).
  if (on_stream) {
    const float coef = sync.stream_coef ? sync.stream_coef() : std::nanf("");
    const bool scale = ResolveStreamCoef(coef, delayed);
    const bool proven = checked && scale;  // the trainer's finite norm covered them
    DOS_LOG_DEBUG("step.stream_coef", "coef", coef, "copied_gradients_kept",
                  scale && delayed != nullptr, "scanned", !proven);
    if (proven) return true;
  }
  return engine_->AllFinite(shard, bindings);
}

absl::Status StepExecutor::WaitForTrainerEvent(const StepRequest& request, const StepSync& sync,
                                               bool on_host) {
  if (!(request.flags & kStepTrainerEventRecorded)) return absl::OkStatus();
  if (sync.trainer_event == nullptr) {
    return absl::InvalidArgumentError(
        "step: flag kStepTrainerEventRecorded is set but the session registered no CUDA IPC "
        "event (RegisterShard.cuda_ipc_event) or its tensors are not in GPU memory; clear the "
        "flag or register the event");
  }
  // On the host first, holding nothing of the engine, where asked. The
  // engine's streams serve every session on its GPU: a stream made to wait
  // for this trainer's event would hold another session's copies and kernels
  // queued behind it until this trainer's backward ends. Their wait below is
  // then already met; it stays, so that no engine relies on the host's wait
  // for its order.
  if (on_host) DOS_RETURN_IF_ERROR(engine_->SyncTrainerEvent(sync.trainer_event));
  return engine_->WaitTrainerEvent(sync.trainer_event);
}

absl::StatusOr<StepOutcome> StepExecutor::Apply(const StepPlan& plan, ShardState& shard,
                                                std::span<const TensorBinding> bindings,
                                                StepKind kind, const StepSync& sync,
                                                StepRequest* request,
                                                NodeResources::Step* node_step,
                                                DelayedHost* delayed) {
  std::span<TensorDesc> tensors = shard.tensors();
  std::vector<cpu::AdamScalars> scalars = Scalars(shard, *request);
  StepMeasurements measured;
  // Weights a delayed step left pending go in first, except for the
  // subgroups this step delays again: the engine installs those itself,
  // each before its gradients are captured.
  if (delayed != nullptr) {
    const std::vector<uint32_t> before = delayed->PendingExcept(plan.delayed);
    if (!before.empty()) {
      DOS_RETURN_IF_ERROR(engine_->InstallDelayed(shard, bindings, *delayed, before));
      delayed->Installed(before);
    }
    if (!plan.delayed.empty()) {
      DOS_RETURN_IF_ERROR(delayed->Place(
          plan.delayed, [this](uint64_t bytes) { return engine_->AllocStaging(bytes); }));
    }
  }
  // Only a step updated per subgroup can learn of tensors without a
  // gradient after its begin.
  std::optional<LateSkip> late;
  StepSync engine_sync = sync;
  if (kind.per_subgroup()) {
    engine_sync = late.emplace(sync, request->seq, tensors.size(), request, &scalars).EngineSync();
  }
  if (!plan.delayed.empty()) {
    delayed->BeginCapture(plan.delayed, scalars, plan.delayed_gpu);
    delayed->update_verdict_ns = kind.awaits_verdict() ? delayed->verdict_ns : 0;
    delayed->update_resident = plan.resident;
    engine_sync.delayed = delayed;
    // Their update starts as soon as the engine queued the captures (each
    // subgroup then waits for its own: DelayedHost::await_capture), beside
    // the rest of the step (the session joins it after the result),
    // or, started at the result, when the session runs it.
    if (!planner_.delayed_start_at_result()) {
      engine_sync.delayed_captured = [this, &shard, delayed] {
        delayed->worker = std::thread([this, &shard, delayed] {
          delayed->worker_run = RunDelayedKernel(shard, *delayed);
          delayed->MarkFinished();  // a session waiting to hand it off joins it instead
        });
      };
    }
  }
  absl::Status executed = engine_->Execute(plan, shard, bindings, scalars, engine_sync, &measured);
  if (!executed.ok()) {
    if (delayed != nullptr && !plan.delayed.empty()) {
      absl::Status ignored = UpdateDelayed(shard, *delayed);  // ends the worker, if it started
      (void)ignored;
    }
    return executed;
  }
  node_step->Finish(StepPlanner::NodeStepEnd(plan, measured));
  planner_.Learn(plan, measured);
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    if (!SkipsTensor(*request, i)) ++tensors[i].step;  // a skipped tensor keeps its count
  }
  StepOutcome out = Outcome(plan, measured);
  out.delayed_subgroups = static_cast<uint32_t>(plan.delayed.size());
  out.delayed_params = plan.delayed_params;
  out.measured_window_us = measured.window_us;
  out.delayed_slack_us = measured.delayed_slack_us;
  return out;
}

void StepExecutor::AddLease(uint64_t session, StepOutcome* out) const {
  if (session == 0) return;
  const GpuLease lease = planner_.sessions().LeaseOf(session);
  out->gpu_lease_bytes = lease.lease_bytes;
  out->trainer_gpu_budget_bytes = lease.budget_bytes;
  out->trainer_gpu_peak_bytes = lease.peak_bytes;
  out->resident_budget_bytes = planner_.sessions().ResidentBytes(session);
}

absl::Status StepExecutor::ApplyLease(ShardState& shard, const StepRequest& request,
                                      const Policy& policy, uint64_t session,
                                      const DelayedHost* delayed) {
  GpuLease lease;
  if (request.flags & kStepGpuLease) {
    lease = GpuLease{.reported = true,
                     .lease_bytes = request.gpu_lease_bytes,
                     .budget_bytes = request.gpu_budget_bytes,
                     .peak_bytes = request.gpu_peak_bytes};
  }
  const ShardLayout layout = planner_.LayoutOf(shard);
  planner_.sessions().SetLease(session, lease, layout);
  if (!engine_->has_gpu()) return absl::OkStatus();
  const uint32_t target = planner_.ResidentTarget(policy, layout, session);
  // Only a shrink: none where the tier is the handed-off update's step's.
  if (delayed != nullptr && delayed->handed_off && target >= delayed->update_resident) {
    return absl::OkStatus();
  }
  return engine_->SetResident(shard, target, /*grow=*/false).status();
}

absl::Status StepExecutor::WriteWeights(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        uint32_t tensor) {
  return WriteWeightsRange(shard, bindings, tensor, 0, shard.tensors()[tensor].numel);
}

absl::Status StepExecutor::WriteWeightsRange(const ShardState& shard,
                                             std::span<const TensorBinding> bindings,
                                             uint32_t tensor, uint64_t offset, uint64_t count) {
  const TensorDesc& t = shard.tensors()[tensor];
  std::vector<float> master(count);
  shard.ReadTensorRange(tensor, 0, offset, count, master.data());
  const uint64_t esize = DTypeSize(t.param_dtype);
  char* param = static_cast<char*>(bindings[tensor].param) + offset * esize;
  if (engine_->host_addressable()) {
    FloatToWeights(master.data(), count, t.param_dtype, param);
    return absl::OkStatus();
  }
  std::vector<char> staging(count * esize);
  FloatToWeights(master.data(), count, t.param_dtype, staging.data());
  return engine_->CopyToTrainer(param, staging.data(), staging.size());
}

absl::Status StepExecutor::ReadWeights(ShardState& shard, std::span<const TensorBinding> bindings,
                                       uint32_t tensor) {
  const TensorDesc& t = shard.tensors()[tensor];
  // Converted straight into the masters' runs, in parallel (no temporary of
  // the whole tensor). Weights the CPU cannot address are first copied into
  // the run's moments (still all zeros, and page-locked when the engine
  // pinned the shard first, so the copy runs at PCIe speed; MasterRun
  // guarantees room for 4 bytes a weight in either state format), converted
  // from there, and zeroed again.
  const bool staged = !engine_->host_addressable();
  const size_t esize = DTypeSize(t.param_dtype);
  const char* base = static_cast<const char*>(bindings[tensor].param);
  for (const ShardState::MasterRun& r : shard.MasterRuns(tensor)) {
    const char* src = base + r.tensor_offset * esize;
    if (staged) {
      DOS_RETURN_IF_ERROR(engine_->CopyToHost(r.moments, src, r.count * esize));
      src = static_cast<const char*>(r.moments);
    }
    WeightsToFloat(src, t.param_dtype, r.count, r.master);
    if (staged) std::memset(r.moments, 0, r.count * esize);
  }
  return absl::OkStatus();
}

}  // namespace dos
