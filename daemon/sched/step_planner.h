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
//   auto            as many leading subgroups resident as the GPU memory
//                   budget holds (largest subgroup's state each); the model's
//                   share x of the rest: half of x's parameters pinned to the
//                   GPU from the front, half of (1 - x)'s pinned to the CPU
//                   from the back, the middle shared and claimed at run time
//                   (more than two subgroups only: with two or fewer every
//                   one is shared).
// Without a GPU (PlanBudgets::gpu false) every policy runs as `cpu`.
//
// The rates start from `PlannerOptions::initial` and are updated (EWMA) from
// each step's measurements: kernel and copy-engine rates into the model, the
// whole paths' throughputs for the claiming rule (TakeShared), the host
// memory bandwidth when both paths ran.
//
// Ownership: one planner per engine (its rates are that device's); it owns
// its model and nothing else. Thread-safety: thread-safe (one mutex); Plan
// and Learn of one engine's steps are expected in step order.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/sched/perf_model.h"
#include "daemon/sched/policy.h"
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
};

class StepPlanner {
 public:
  explicit StepPlanner(const PlannerOptions& options = {});
  StepPlanner(const StepPlanner&) = delete;
  StepPlanner& operator=(const StepPlanner&) = delete;

  // The plan of one step of a shard of `layout` under `policy`.
  StepPlan Plan(const Policy& policy, const ShardLayout& layout) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for a registered shard (its layout read with the options' grad_fp32).
  StepPlan Plan(const Policy& policy, const ShardState& shard) ABSL_LOCKS_EXCLUDED(mu_);
  // Learns from what executing `plan` measured; appends the step's timeline
  // when configured.
  void Learn(const StepPlan& plan, const StepMeasurements& measured) ABSL_LOCKS_EXCLUDED(mu_);

  const PlanBudgets& budgets() const { return options_.budgets; }
  PerfInputs model_inputs() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whole-path throughputs learned so far (0: not measured yet).
  double cpu_path_rate() const ABSL_LOCKS_EXCLUDED(mu_);
  double gpu_path_rate() const ABSL_LOCKS_EXCLUDED(mu_);

  // The pure parts, for tests and the benchmark's report.
  // Subgroups resident under `policy` for `layout` within `budgets`.
  static uint32_t ResidentCount(const Policy& policy, const ShardLayout& layout,
                                const PlanBudgets& budgets);
  // The model's inputs with the budgets' bandwidth caps applied.
  static PerfInputs Capped(const PerfInputs& in, const PlanBudgets& budgets);

 private:
  const PlannerOptions options_;
  mutable absl::Mutex mu_;
  PerfModel model_ ABSL_GUARDED_BY(mu_);
  double cpu_path_rate_ ABSL_GUARDED_BY(mu_) = 0;
  double gpu_path_rate_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dos
