// StepPlan: what the planner decides for one step of one shard, and what the
// engine that executes it measures. Plain data: the planner (step_planner.h)
// writes plans and reads measurements; engines read plans and write
// measurements, and never interpret a policy themselves.
//
// A plan puts each subgroup on one of three paths (DESIGN.md section 3):
//  - resident: subgroups [0, resident) keep their state in GPU memory; the
//    fused kernel alone updates them.
//  - streamed (GPU path): the state crosses PCIe through a staging slot.
//  - CPU path: the CPU kernel updates the host state.
// The streamed and CPU subgroups are given as a SubgroupQueue's three lists:
// pinned to the GPU (`gpu_only`, in the order the GPU takes them), pinned to
// the CPU (`cpu_only`, in the order the CPU takes them) and `shared`, which
// the two sides claim from opposite ends while the step runs (`auto`'s
// dynamic claiming; TakeShared is the GPU side's rule).
//
// Every list is in the order its side executes it, and the plan says when
// the resident kernels run and whether a subgroup's gradients must be
// waited for (`wait_ready`): the planner orders a step by its StepKind
// (step_kind.h), engines take the lists as they are.
//
// Thread-safety: a plan is immutable once made; any number of threads may
// read it (TakeShared included).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/sched/perf_model.h"
#include "daemon/sched/policy.h"
#include "daemon/sched/subgroup_queue.h"

namespace dos {

class ShardState;

// What the planner needs to know about a shard: its subgroups' sizes and the
// bytes per parameter its CPU path moves over PCIe.
struct ShardLayout {
  std::vector<uint64_t> subgroup_numel;
  double grad_bytes = 2;    // gradient bytes D2H per CPU-path parameter
  double weight_bytes = 2;  // weight bytes H2D per CPU-path parameter
  double state_bytes = 12;  // state bytes per parameter (ShardState::bytes_per_param)

  // The largest subgroup's parameters (0 without subgroups) and its state:
  // each resident subgroup and each staging slot is charged that much.
  uint64_t max_subgroup_numel() const {
    uint64_t m = 0;
    for (uint64_t n : subgroup_numel) m = std::max(m, n);
    return m;
  }
  uint64_t max_subgroup_state_bytes() const {
    return max_subgroup_numel() * static_cast<uint64_t>(state_bytes);
  }

  // From a registered shard: tensor 0's dtypes (a CPU path that casts the
  // gradients to fp32 on the GPU first sends 4 bytes: `grad_fp32`) and the
  // shard's state format.
  static ShardLayout Of(const ShardState& shard, bool grad_fp32);
};

// GPU memory a staging slot takes per element, beyond the state, for a
// delayed update's gradients and weights when they are staged on the GPU
// (PlanBudgets::staging_io): 4 bytes each at most (fp32).
inline constexpr uint64_t kStagedIoBytesPerParam = 8;

// The limits a plan must respect beyond the measured rates.
struct PlanBudgets {
  // Whether a GPU executes the plan; false: every subgroup on the CPU,
  // whatever the policy (a host-memory session, or no GPU).
  bool gpu = false;
  // GPU memory `auto` may fill with resident state, beyond the staging slots
  // (--gpu_memory_budget). Sessions that report a GPU lease are sized from it
  // and this is then only a cap on all of them together (0: no cap); for a
  // session without a lease it is the whole budget (0: nothing resident).
  uint64_t gpu_resident_bytes = 0;
  // Staging slots the engine streams through (GpuEngineOptions): a lease
  // pays for them before resident state.
  uint32_t staging_slots = 2;
  // Each slot also holds a delayed update's gradients and weights
  // (kStagedIoBytesPerParam per element: --delayed_gpu_staged).
  bool staging_io = false;
  // Caps on what the step may use, in bytes/s; 0: no cap (the measured rates
  // alone). PCIe per direction (both directions together get twice it), host
  // memory for cores and DMA engines together.
  double pcie_bytes_per_s = 0;
  double host_bytes_per_s = 0;
};

// One session's GPU lease as its client last reported it (kStepGpuLease in
// dos/wire/control_block.h): what the trainer lends dosd from its budget.
struct GpuLease {
  bool reported = false;      // false: none yet (gpu_resident_bytes alone decides)
  uint64_t lease_bytes = 0;   // GPU memory dosd may hold for the session
  uint64_t budget_bytes = 0;  // the trainer's budget and measured peak (stats)
  uint64_t peak_bytes = 0;
};

struct StepPlan {
  Policy policy;
  uint32_t num_subgroups = 0;
  uint32_t resident = 0;           // subgroups [0, resident) are resident on the GPU
  // The resident subgroups in the order their kernels run, before the
  // streamed subgroups (`resident_first`) or after them.
  std::vector<uint32_t> resident_order;
  bool resident_first = true;
  // Engines wait for each subgroup's gradients (StepSync::wait_ready)
  // before they read them, and every list is in the order the gradients
  // become final (StepKind::per_subgroup); false: all are final already.
  bool wait_ready = false;
  std::vector<uint32_t> gpu_only;  // streamed, GPU order
  std::vector<uint32_t> cpu_only;  // CPU path, CPU order
  std::vector<uint32_t> shared;    // claimed at run time (auto), GPU from the front
  // A delayed step (StepKind::delays_host): the CPU path's subgroups, whose
  // gradients the engine only captures (StepSync::delayed); with any of them
  // cpu_only and shared are empty. The planner's view of the iteration:
  // the trainer's measured time between steps and the update it waits for.
  std::vector<uint32_t> delayed;
  uint64_t delayed_params = 0;
  // Of `delayed`, those updated on the GPU during the window (streamed then,
  // not on the CPU: PlannerOptions::delayed_gpu, dosd --delayed_gpu_path)
  // and their parameters (counted in delayed_params too).
  std::vector<uint32_t> delayed_gpu;
  uint64_t delayed_gpu_params = 0;
  double window_us = 0;
  double predicted_iter_us = 0;
  // f of PerfModel::DelayedStep: the streamed path's stretch while the
  // delayed update shares host memory with it (1: no overlap or room).
  double host_slowdown = 1;
  std::vector<uint64_t> numel;     // per subgroup
  uint64_t max_numel = 0;          // largest subgroup (the staging buffers' size)
  uint64_t resident_params = 0;
  uint64_t streamed_params = 0;    // every non-resident parameter (GPU path or CPU)
  // The model's view: GPU share x of the streamed parameters (auto: the
  // model's optimum; fixed policies: their own share), the constraint that
  // limits the step, the predicted phase time.
  double gpu_share = 0;
  std::string binding;
  double predicted_us = 0;
  PerfInputs inputs;               // the rates the plan was made with
  // This engine's share of the node's host memory bandwidth and CPU cores
  // (NodeResources; 1: alone or no node view); `inputs` carry it.
  double node_share = 1;
  // Whole-path throughputs (copies and waits included) for the claiming
  // rule: CPU path params/s (an estimate until measured), GPU path params/s
  // (0 until measured).
  double cpu_path_rate = 0;
  double gpu_path_rate = 0;

  // The queue the engine's GPU and CPU sides claim this plan's non-resident
  // subgroups from.
  SubgroupQueue MakeQueue() const { return SubgroupQueue(gpu_only, cpu_only, shared, numel); }
  // The GPU side's rule for a shared subgroup (`claim`: its size, the
  // shared parameters still unclaimed, what the CPU still has of its own):
  // take it when, with `in_flight` subgroups already in its pipeline, the
  // GPU would finish it sooner than the CPU would, given what each still has
  // to do.
  bool TakeShared(const SubgroupQueue::SharedClaim& claim, size_t in_flight) const;
};

// One timeline entry: which subgroup ran where and when (microseconds from
// the step's start). Path 'r' resident, 'g' streamed, 'c' CPU, 'd' delayed (its
// gradients captured for the delayed host path); `in` is the
// inbound copy (state H2D or gradients D2H), `out` the outbound one.
struct TimelineEntry {
  uint32_t subgroup = 0;
  char path = 'c';
  double in0 = 0, in1 = 0, k0 = 0, k1 = 0, out0 = 0, out1 = 0;
};

// What an engine measured while executing a plan.
struct StepMeasurements {
  uint64_t cpu_params = 0;        // CPU path
  uint64_t gpu_params = 0;        // resident and streamed
  uint64_t streamed_params = 0;   // streamed only
  uint64_t gpu_h2d_bytes = 0;     // GPU path state copies (in the phase)
  uint64_t prefetched_bytes = 0;  // GPU path state copied H2D before it (Engine::Prefetch)
  uint64_t prefetched_params = 0; // the streamed parameters whose state that was
  uint64_t gpu_d2h_bytes = 0;
  uint64_t cpu_h2d_bytes = 0;     // CPU path weights
  uint64_t cpu_d2h_bytes = 0;     // CPU path gradients
  double cpu_kernel_us = 0;       // CPU kernel time
  double gpu_kernel_us = 0;       // GPU kernel time
  double h2d_us = 0;              // GPU path copy-engine time per direction
  double d2h_us = 0;
  double cpu_loop_us = 0;         // CPU path wall time, copies and waits included
  double gpu_loop_us = 0;         // GPU path wall time
  double wall_us = 0;             // the whole update
  // GPU engines: the trainer's time between the previous step's end and
  // this step's gradients (its forward and backward), measured on the GPU
  // (0: unknown); how long its gradients came after the last delayed
  // update ended (negative: the update ended that long after them: the
  // part not hidden).
  double window_us = 0;
  double delayed_slack_us = 0;
  uint64_t gpu_memory_bytes = 0;  // staging and resident memory held on the GPU
  std::vector<TimelineEntry> entries;  // one per subgroup updated
};

}  // namespace dos
