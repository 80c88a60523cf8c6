// StepExecutor: runs one optimizer step of one shard on one engine.
//
// A step: validate the hyperparameters (ValidateStepRequest), make the
// engine wait for the trainer's event when the step says it was recorded,
// ask the planner for the step's plan (with a session, the resident tier is
// resized to the planner's target for it first: a shrink already happened in
// ApplyLease; a grow may stop short when the device is full; the plan is made
// for what the engine then holds), let the engine prefetch the first
// streamed subgroups' state (Engine::Prefetch: none of this depends on the
// gradients, so it overlaps the end of backward), scan the gradients for
// non-finite values (unless the client already did; this waits for the
// trainer's event), compute each tensor's Adam scalars, have the engine
// execute the plan, and let the planner learn from what the engine
// measured. A step with non-finite gradients applies nothing and leaves
// every step counter unchanged, as AMP's GradScaler skips optimizer.step().
//
// Ownership: one executor per engine (ExecutorSet); it owns that engine's
// planner (its rates are the engine's) and a pointer to the engine, which
// outlives it. Thread-safety: Run may be called concurrently for different
// shards; the caller serialises calls for one shard.
// Files: step_executor.cc (the step), step_executor_delayed.cc (the delayed
// host path's installs and update, an early step's verdict with its captures).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/sched/engine.h"
#include "daemon/sched/policy.h"
#include "daemon/sched/step_kind.h"
#include "daemon/sched/step_planner.h"
#include "daemon/state/shard_state.h"
#include "dos/wire/control_block.h"

namespace dos {

struct StepOutcome {
  bool found_inf = false;
  int64_t step = 0;             // tensor 0's step count after the step
  double update_us = 0;         // time spent updating (scan included)
  uint64_t cpu_subgroups = 0;
  uint64_t gpu_subgroups = 0;      // streamed through staging slots
  uint64_t resident_subgroups = 0; // updated in place in GPU memory
  // GPU engines only (zero on the host engine):
  uint64_t cpu_params = 0;
  uint64_t gpu_params = 0;         // streamed and resident
  uint64_t h2d_bytes = 0;          // state, weights (prefetched state included)
  uint64_t prefetched_bytes = 0;   // state copied H2D before the verdict (Engine::Prefetch)
  uint64_t d2h_bytes = 0;          // state, gradients
  double cpu_busy_us = 0;          // CPU kernel time
  double gpu_busy_us = 0;          // GPU kernel time
  double h2d_busy_us = 0;          // copy-engine time per direction
  double d2h_busy_us = 0;
  double predicted_us = 0;         // the performance model's forecast
  double model_gpu_share = 0;      // x the model chose (auto) or the policy implies
  std::string model_binding;       // the constraint the model says limits the step
  double node_share = 1;           // share of the node's host bandwidth and cores planned with
  uint64_t gpu_memory_bytes = 0;   // staging slots + resident state on the GPU
  // The session's GPU lease (0 without one), what its trainer reported with
  // it, and the resident budget the planner gave the session.
  uint64_t gpu_lease_bytes = 0;
  uint64_t trainer_gpu_budget_bytes = 0;
  uint64_t trainer_gpu_peak_bytes = 0;
  uint64_t resident_budget_bytes = 0;
  // Early steps (kStepGradientsPending): microseconds from the request to
  // the verdict (verdict steps) and from the verdict, or for steps without
  // one from the request, to the end of the update.
  bool early = false;
  double before_verdict_us = 0;
  double after_verdict_us = 0;
  // The delayed host path (StepKind::delays_host): this step's deferred
  // subgroups; the planner's window and predictions; how long the trainer's
  // gradients came after the last delayed update ended (GPU engines;
  // negative: it waited that long; 0 unknown) and the window measured on
  // the GPU (0: unknown).
  uint32_t delayed_subgroups = 0;
  uint64_t delayed_params = 0;
  double window_us = 0;
  double predicted_iter_us = 0;
  double measured_window_us = 0;
  double delayed_slack_us = 0;
  // Filled by the session: the previous delayed update's time and the part
  // of it this step waited for.
  double delayed_update_us = 0;
  double delayed_wait_us = 0;
};

// How an early step's verdict reaches the executor: waits for it and returns
// the step's final request (INVALID_ARGUMENT-free: Run validates it).
using AwaitVerdict = std::function<absl::StatusOr<StepRequest>()>;

// The whole request: one group per registered group, grad_scale > 0 and
// clip_coef >= 0 (finite), and every group by ValidateGroupStepParams
// (dos/wire/hparams.h, in the library the client links too).
absl::Status ValidateStepRequest(const StepRequest& request, size_t num_groups);

class StepExecutor {
 public:
  // `planner.budgets.gpu` is taken from the engine.
  StepExecutor(Engine* engine, PlannerOptions planner = {});

  Engine* engine() const { return engine_; }
  StepPlanner& planner() { return planner_; }

  // A step of `kind` (decided from the request's flags where the request
  // was read: StepKind::Decode). `session` (non-zero) sizes the resident
  // tier from the session's lease (ApplyLease first); 0: from the planner's
  // budgets alone. Per kind:
  //   synchronous    the request is final; `sync` carries the trainer's event.
  //   per subgroup   the request is final and `sync.wait_ready`/`is_ready`
  //                  must be set: the plan waits for each subgroup's
  //                  gradients and takes them in readiness order.
  //   at verdict     the plan is made (and the resident tier grown) first,
  //                  then `await_verdict` gives the final request and the
  //                  step runs as a synchronous one would (kStepAbandon in
  //                  it: ABORTED, nothing applied).
  // The request's flags that make the kind are not read again here.
  absl::StatusOr<StepOutcome> Run(ShardState& shard, std::span<const TensorBinding> bindings,
                                  const StepRequest& request, StepKind kind, const Policy& policy,
                                  const StepSync& sync, uint64_t session,
                                  const AwaitVerdict& await_verdict,
                                  DelayedHost* delayed = nullptr);
  // The delayed host path (delayed_host.h), for the session that owns
  // `delayed`: a delayed step (`kind.delays_host()`, Run above) captures the
  // gradients of its plan's delayed subgroups and leaves their update to
  // UpdateDelayed, which the session calls after posting the result; any
  // other step, and InstallPending, installs the weights left pending first.
  // The update starts as soon as the engine has the gradients (on a thread
  // of its own, beside the step's GPU path); UpdateDelayed waits for it.
  // kind.finishes_delayed(): Run installs them and applies nothing.
  // With --delayed_handoff the session may leave the update running and
  // pass it to the next early delayed step's Run, which joins it at its
  // verdict (before, where its plan or resident tier would touch a subgroup
  // the update writes: DelayedHost, "a hand-off"); `keep_early` there keeps
  // that step's early captures. Each update logs `delayed.update` (debug)
  // for `session`.
  absl::Status UpdateDelayed(ShardState& shard, DelayedHost& delayed, uint64_t session = 0,
                             bool keep_early = false);
  // UpdateDelayed where no step's result can carry its error: a failure is
  // logged (step.delayed_update_failed), the update's own, not a step's.
  void FinishUpdate(ShardState& shard, DelayedHost& delayed, uint64_t session,
                    bool keep_early = false);
  // FinishUpdate for an update the session handed off, once.
  void JoinHandOff(ShardState& shard, DelayedHost* delayed, uint64_t session, bool keep_early);
  bool delayed_handoff() const { return planner_.delayed_handoff(); }
  absl::Status InstallPending(const ShardState& shard, std::span<const TensorBinding> bindings,
                              DelayedHost& delayed);
  // A synchronous step (tests, benchmarks).
  absl::StatusOr<StepOutcome> Run(ShardState& shard, std::span<const TensorBinding> bindings,
                                  const StepRequest& request, const Policy& policy,
                                  const StepSync& sync = {}, uint64_t session = 0);

  // A step's GPU lease (kStepGpuLease in `request`; without it the session
  // keeps its last one), applied before anything else of the step: the
  // planner records it, and if the session's resident target fell the engine
  // copies the state it no longer covers back to the host and frees its GPU
  // memory before this returns. Growing waits for Run.
  // `delayed` (the session's, if any): a hand-off's step whose lease keeps
  // the resident tier leaves the engine alone (its delayed update's GPU share
  // holds the engine through the window).
  absl::Status ApplyLease(ShardState& shard, const StepRequest& request, const Policy& policy,
                          uint64_t session, const DelayedHost* delayed = nullptr);
  // A session whose shard this executor steps (its register). While another
  // one is bound too, a per-subgroup step on a GPU engine waits on the host
  // for all its gradients before it takes the engine: the engine runs one
  // step at a time, and one that waited for each subgroup's gradients inside
  // would hold every other session on the GPU until its trainer's backward
  // ends (a stalled trainer: up to --early_step_ready_timeout).
  void BindSession(uint64_t session) { planner_.sessions().Bind(session); }
  // The session is gone (or moved to another executor): its share of the
  // engine's GPU goes to the others, and it is no longer bound.
  void ForgetSession(uint64_t session) { planner_.sessions().Forget(session); }
  // Its trainer died (the session waits for a resume): no step of another
  // session waits for it any more; its resident state stays until
  // ForgetSession.
  void UnbindSession(uint64_t session) { planner_.sessions().Unbind(session); }

  // Rewrites every trainer weight from the master weights (after a state
  // import or a checkpoint load), in the parameter's dtype.
  absl::Status WriteWeights(const ShardState& shard, std::span<const TensorBinding> bindings,
                            uint32_t tensor);
  // The same for elements [offset, offset + count) of the tensor (a ranged
  // state import); the caller checks that the range lies inside it.
  absl::Status WriteWeightsRange(const ShardState& shard, std::span<const TensorBinding> bindings,
                                 uint32_t tensor, uint64_t offset, uint64_t count);
  // Initialises tensor `tensor`'s fp32 master weights from the trainer's
  // weights.
  absl::Status ReadWeights(ShardState& shard, std::span<const TensorBinding> bindings,
                           uint32_t tensor);

 private:
  static PlannerOptions WithEngine(PlannerOptions options, const Engine& engine);
  StepOutcome Outcome(const StepPlan& plan, const StepMeasurements& measured) const;
  // Run's parts, in order: the resident tier the step plans with; an early
  // step's final request (its verdict, checked); the trainer's event; the
  // update of a step whose gradients are finite (the request's mask may
  // grow with tensors published late); the session's lease figures.
  absl::StatusOr<uint32_t> ResidentFor(ShardState& shard, const ShardLayout& layout,
                                       const Policy& policy, uint64_t session, StepKind kind,
                                       DelayedHost* delayed);
  absl::StatusOr<StepRequest> AwaitFinalRequest(const ShardState& shard,
                                                const AwaitVerdict& await_verdict);
  // AwaitFinalRequest for an early step; a delayed one captures its delayed
  // subgroups meanwhile (EarlyCapture).
  // A hand-off's update is joined once the captures stop (JoinHandOff).
  absl::StatusOr<StepRequest> AwaitVerdictCapturing(const StepPlan& plan, ShardState& shard,
                                                    std::span<const TensorBinding> bindings,
                                                    StepKind kind, const StepSync& sync,
                                                    const AwaitVerdict& await_verdict,
                                                    DelayedHost* delayed, uint64_t session);
  // What the update multiplies the gradients captured before `verdict` by
  // (kStepGradientsScaled: the trainer's in-place multiply after the
  // captures stopped, `stopped`), or nullopt where they must be copied again
  // (no such flag, or a multiply the update cannot repeat bit for bit).
  static std::optional<float> ScaledCoef(const StepRequest& verdict, const ShardState& shard,
                                         bool stopped);
  // Whether every gradient the step reads is finite: the trainer's word
  // (kStepGradientsChecked), else dosd's scan, after a host wait for the
  // trainer's event where one was recorded. With
  // kStepGradientsScaledOnStream the coefficient the trainer's stream copied
  // is read after that wait (ResolveStreamCoef); with kStepGradientsChecked
  // beside it, a coefficient that is a scale says the trainer's norm over
  // these gradients was finite and dosd does not scan, anything else is
  // scanned.
  absl::StatusOr<bool> GradientsFinite(const StepRequest& request, const ShardState& shard,
                                       std::span<const TensorBinding> bindings,
                                       const StepSync& sync, DelayedHost* delayed);
  // A verdict with kStepGradientsScaledOnStream, once the trainer's event
  // has completed: whether `coef`, what its stream copied, is a scale
  // (finite and >= 0). For a delayed step (`delayed` set) it replaces the
  // verdict's placeholder, or, when it is not a scale, the gradients
  // captured before the verdict are copied again (as
  // kStepGradientsRewritten).
  static bool ResolveStreamCoef(float coef, DelayedHost* delayed);
  // Makes the engine's streams wait for the trainer's event, after a wait on
  // the host when `on_host`.
  absl::Status WaitForTrainerEvent(const StepRequest& request, const StepSync& sync, bool on_host);
  absl::StatusOr<StepOutcome> Apply(const StepPlan& plan, ShardState& shard,
                                    std::span<const TensorBinding> bindings, StepKind kind,
                                    const StepSync& sync, StepRequest* request,
                                    NodeResources::Step* node_step, DelayedHost* delayed);
  void AddLease(uint64_t session, StepOutcome* out) const;
  // The CPU kernel of the delayed subgroups (on the worker thread a delayed
  // step starts, or inline), timed for the planner.
  DelayedHost::Run RunDelayedKernel(ShardState& shard, const DelayedHost& delayed);

  // Whether a session other than `session` is bound (BindSession).
  bool SharesEngine(uint64_t session) const { return planner_.sessions().Shared(session); }

  Engine* const engine_;
  StepPlanner planner_;
};

}  // namespace dos
