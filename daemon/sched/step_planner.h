// StepPlanner: every scheduling decision of a step, in one place and without
// CUDA (DESIGN.md section 4). From the session's policy, the performance
// model, the shard's layout and the budgets it makes the step's plan (which
// subgroups stay resident on the GPU, which are streamed through it, which
// the CPU updates, in what order, and the predicted time), and it learns the
// machine's rates from each step's measurements.
//
// The rules, per policy (n subgroups, the GPU present):
//   cpu             every subgroup on the CPU, in order.
//   static:<f>      subgroups [0, round(f n)) resident, the rest on the CPU.
//   interleave:<k>  every k-th subgroup (0, k, 2k, ...) streamed, the rest on
//                   the CPU.
//   auto            as many leading subgroups resident as the session's
//                   resident budget holds (largest subgroup's state each:
//                   see "Resident tier" below); the model's
//                   share x of the rest: half of x's parameters pinned to the
//                   GPU from the front, half of (1 - x)'s pinned to the CPU
//                   from the back, the middle shared and claimed at run time
//                   (more than two subgroups only: with two or fewer every
//                   one is shared).
// Without a GPU (PlanBudgets::gpu false) every policy runs as `cpu`.
//
// Resident tier: each session of the engine gets its own resident budget,
// from the GPU lease it reports (EngineSessions, sessions(): which sessions
// the engine serves and what each asks for). A `static:<f>` session with a
// lease keeps no more than its lease holds. The executor asks
// ResidentTarget, lets the engine grow or shrink the tier (growing may stop
// short when the device is full), then plans with what the engine holds.
//
// Shared host: with PlannerOptions::node, R_cpu and M_host are the node's
// (node_resources.h), and each plan uses this engine's share of them among
// the engines stepping at the same time (StepPlan::node_share): `auto`'s
// split, the claiming rule's first estimate and the prediction all see the
// other ranks. The executor brackets each step with BeginStep (which tells
// the node the step's host demand) and hands the node its measurements.
//
// Order (StepKind): a step whose gradients are all final when it runs
// (synchronous, or early with a verdict) takes the resident subgroups first,
// 0 up, then each list from its front. A step updated per subgroup as its
// gradients become final (StepKind::per_subgroup) is planned in readiness
// order: backward makes the last subgroups' gradients final first, so the
// pinned lists (gpu_only, cpu_only) and the resident subgroups run back to
// front, the resident ones after the streamed (they hold the first layers,
// final last), and `shared` keeps its ends (the CPU already claims from the
// back); the plan says to wait for each subgroup (wait_ready).
//
// The rates start from `PlannerOptions::initial` and are updated (EWMA) from
// each step's measurements: kernel and copy-engine rates into the model, the
// whole paths' throughputs for the claiming rule (TakeShared), the host
// memory bandwidth when both paths ran.
//
// Ownership: one planner per engine (its rates are that device's); it owns
// its model and the engine's EngineSessions. Thread-safety: thread-safe
// (one mutex, and the sessions' own); Plan and Learn of one engine's steps
// are expected in step order.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/sched/engine_sessions.h"
#include "daemon/sched/node_resources.h"
#include "daemon/sched/perf_model.h"
#include "daemon/sched/policy.h"
#include "daemon/sched/step_kind.h"
#include "daemon/sched/step_plan.h"
#include "daemon/state/shard_state.h"

namespace dos {

struct PlannerOptions {
  PlanBudgets budgets;
  PerfInputs initial;         // the model's starting rates
  std::string timeline_path;  // append one JSON line per GPU step (for plots); empty: off
  // The engine casts CPU-path gradients to fp32 on the GPU before D2H
  // (--gpu_cpu_grad_fp32): 4 bytes per parameter cross PCIe, not 2.
  bool grad_fp32 = false;
  // A delayed step's update starts once its result is posted (the session
  // runs it then), not as soon as the gradients are captured: the step's
  // GPU path then has host memory to itself, and the update has only the
  // trainer's window (--delayed_update_start).
  bool delayed_start_at_result = false;
  // The session hands a running delayed update to the trainer's next early
  // step (--delayed_handoff): that step begins beside it, and its captures
  // during backward take each subgroup as soon as the update is done with
  // it (DelayedHost, "a hand-off").
  bool delayed_handoff = false;
  // A delayed step delays its streamed subgroups too (--delayed_gpu_path,
  // dosd's default): their gradients are captured with the host path's and
  // their update streams through the staging slots during the window, on
  // PCIe the trainer's forward and backward leave idle. Under auto as many
  // as the window's PCIe time holds (90%); other policies all of them. Only
  // while one session steps on the engine (EngineSessions::Alone): the
  // update holds the staging slots through the window.
  bool delayed_gpu = false;
  // With delayed_gpu: the GPU also takes the host path's delayed subgroups
  // first, as many as the window's PCIe time holds beside the streamed ones,
  // and the CPU updates only the rest (--delayed_gpu_first): the copy
  // engines' traffic instead of the host cores' beside a trainer whose
  // launch thread the CPU update slows.
  bool delayed_gpu_first = false;
  // The share of the window (the model's PCIe time) the GPU's delayed update
  // may take (--delayed_gpu_window_share).
  double delayed_gpu_window_share = 0.9;
  // The node's shared resources (host memory bandwidth, CPU cores) and this
  // engine's id there; null: the engine has the host to itself (the model's
  // own rates, as before).
  NodeResources* node = nullptr;
  int node_engine = -1;
};

class StepPlanner {
 public:
  explicit StepPlanner(const PlannerOptions& options = {});
  StepPlanner(const StepPlanner&) = delete;
  StepPlanner& operator=(const StepPlanner&) = delete;

  // The plan of one step of a shard of `layout` under `policy`, sized by
  // budgets.gpu_resident_bytes alone (no session: tests, benchmarks).
  StepPlan Plan(const Policy& policy, const ShardLayout& layout) ABSL_LOCKS_EXCLUDED(mu_);
  // The plan of a session's step of `kind` when its engine holds subgroups
  // [0, resident) resident (at most ResidentTarget's count).
  // A delayed step (kind.delays_host) also gets the trainer's last measured
  // time between steps, `window_us` (0: unknown: the step is planned as an
  // exact one, nothing delayed).
  StepPlan Plan(const Policy& policy, const ShardLayout& layout, uint32_t resident,
                StepKind kind = {}, double window_us = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // The delayed host path's budget: the parameters the CPU updates within
  // `window_us` (90% of it) at its delayed rate (learned: LearnDelayed; the
  // model's CPU rate until then); unbounded for policies that put their
  // subgroups on the CPU by rule (cpu, static, interleave) and for engines
  // without a GPU.
  double DelayedBudgetParams(const Policy& policy, double window_us) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Under `auto` with a delay: the most subgroups a session should keep
  // resident so that the tail that fits DelayedBudgetParams goes to the
  // host (resident subgroups cannot be delayed: their state is on the GPU);
  // the subgroup count (no cap) otherwise.
  uint32_t DelayedResidentCap(const Policy& policy, const ShardLayout& layout,
                              double window_us) const ABSL_LOCKS_EXCLUDED(mu_);
  // Learns the delayed update's rate (params per second of its CPU time).
  void LearnDelayed(uint64_t params, double update_us) ABSL_LOCKS_EXCLUDED(mu_);

  // Resident tier (above): the sessions the engine serves, keyed by id.
  EngineSessions& sessions() { return sessions_; }
  const EngineSessions& sessions() const { return sessions_; }
  // Subgroups `session` should keep resident under `policy`.
  uint32_t ResidentTarget(const Policy& policy, const ShardLayout& layout, uint64_t session) const;
  // The same for a registered shard (its layout read with the options' grad_fp32).
  StepPlan Plan(const Policy& policy, const ShardState& shard) ABSL_LOCKS_EXCLUDED(mu_);
  ShardLayout LayoutOf(const ShardState& shard) const {
    return ShardLayout::Of(shard, options_.grad_fp32);
  }
  // A step of this engine starts with `resident` of `layout`'s subgroups
  // resident: the node (if any) counts it active until the Step ends.
  NodeResources::Step BeginStep(const ShardLayout& layout, uint32_t resident) const;
  // What the node learns from a step that executed `plan`.
  static NodeResources::StepEnd NodeStepEnd(const StepPlan& plan, const StepMeasurements& m);
  // Host bytes a step moved: per CPU-path parameter the kernel's 2s of state
  // plus the gradient and weight, each once by the kernel and once by DMA;
  // the GPU path's state crosses host memory twice (H2D read, D2H write).
  static double HostBytes(const StepPlan& plan, const StepMeasurements& m);
  // Learns from what executing `plan` measured; appends the step's timeline
  // when configured.
  void Learn(const StepPlan& plan, const StepMeasurements& measured) ABSL_LOCKS_EXCLUDED(mu_);

  const PlanBudgets& budgets() const { return options_.budgets; }
  bool delayed_start_at_result() const { return options_.delayed_start_at_result; }
  bool delayed_handoff() const {
    return options_.delayed_handoff && !options_.delayed_start_at_result;
  }
  NodeResources* node() const { return options_.node; }
  int node_engine() const { return options_.node_engine; }
  // The model's rates (with a node view, R_cpu and M_host are the node's).
  PerfInputs model_inputs() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whole-path throughputs learned so far (0: not measured yet).
  double cpu_path_rate() const ABSL_LOCKS_EXCLUDED(mu_);
  double gpu_path_rate() const ABSL_LOCKS_EXCLUDED(mu_);

  // The pure parts, for tests and the benchmark's report.
  // Puts `plan`'s lists in the order a step of `kind` executes them (above).
  static void OrderFor(StepKind kind, StepPlan& plan);
  // Moves CPU-path subgroups of `plan` (cpu_only in its order, then shared
  // from the CPU's end) into plan.delayed while their parameters fit
  // `budget_params`; the CPU-path subgroups left go to the GPU (gpu_only),
  // so that a delayed plan has no exact CPU work. Without a GPU every
  // subgroup is delayed.
  static void PlaceDelayed(StepPlan& plan, double budget_params);
  // Subgroups resident under `policy` for `layout` within `budgets`.
  static uint32_t ResidentCount(const Policy& policy, const ShardLayout& layout,
                                const PlanBudgets& budgets);
  // The model's inputs with the budgets' bandwidth caps applied.
  static PerfInputs Capped(const PerfInputs& in, const PlanBudgets& budgets);

 private:
  StepPlan PlanWith(const Policy& policy, const ShardLayout& layout, uint32_t resident,
                    StepKind kind, double window_us) ABSL_LOCKS_EXCLUDED(mu_);
  // Under auto: the delayed parameters whose update, started once their
  // gradients are captured, ends within 90% of the rest of the GPU path and
  // the window (the CPU side's tail, in PlaceDelayed's order).
  double AutoDelayedBudget(const StepPlan& plan, double window_us) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // PerfModel::DelayedStep for `plan` with `streamed` parameters on the GPU
  // path and `delayed` on the host path.
  DelayedStepTimes TimeDelayed(const StepPlan& plan, double streamed, double delayed,
                               uint64_t max_streamed, double window_s, double delayed_gpu = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // With delayed_gpu: moves the GPU path's subgroups, in its order, to the
  // delayed ones updated on the GPU in the window (StepPlan::delayed_gpu),
  // then with delayed_gpu_first the CPU's delayed ones, last first: under
  // auto (`by_window`) while their transfers fit 90% of the window,
  // otherwise all; none unless the plan's session is `alone` on the engine.
  void PlaceDelayedGpu(StepPlan& plan, double window_us, bool by_window, bool alone) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The delayed update's rate, params/s: learned (LearnDelayed), else the
  // CPU kernel's rate for `in`.
  double DelayedRate(const PerfInputs& in) const ABSL_LOCKS_EXCLUDED(mu_);
  // A delayed plan's prediction (plan.predicted_us: the update the trainer
  // waits for; plan.predicted_iter_us: with its window).
  void PredictDelayed(StepPlan& plan, uint64_t max_streamed) const ABSL_LOCKS_EXCLUDED(mu_);

  const PlannerOptions options_;
  mutable absl::Mutex mu_;
  EngineSessions sessions_;
  PerfModel model_ ABSL_GUARDED_BY(mu_);
  double cpu_path_rate_ ABSL_GUARDED_BY(mu_) = 0;
  double gpu_path_rate_ ABSL_GUARDED_BY(mu_) = 0;
  double delayed_rate_ ABSL_GUARDED_BY(mu_) = 0;  // params/s of the delayed update
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dos
