#include "daemon/sched/step_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "daemon/common/log.h"
#include "daemon/sched/step_timeline.h"
#include "daemon/state/shard_state.h"

namespace dos {
namespace {

// The CPU path's throughput before it was measured, as a share of the CPU
// kernel's rate (its copies and waits cost the rest).
constexpr double kCpuPathShareOfKernel = 0.6;
// Weight of a new sample in the whole-path throughput averages.
constexpr double kPathRateAlpha = 0.3;

double Ewma(double old_value, double sample) {
  return old_value > 0 ? (1 - kPathRateAlpha) * old_value + kPathRateAlpha * sample : sample;
}

double CapAt(double value, double cap) { return cap > 0 ? std::min(value, cap) : value; }

// `auto` with more than two shared subgroups: pin half of each side's share
// by the model's x. The GPU pipeline owns the front, the CPU pool the back,
// so both start at once, and the middle stays shared for dynamic claiming
// (GPU from its front, CPU from its back) to balance the phase's end. Pinning
// all of x made a misjudged x final (measured: the GPU pipeline idle for the
// last quarter of a step while the CPU worked through its pins); not pinning
// at all let the GPU claim nearly everything in the first steps.
void PinHalfOfEachShare(StepPlan& plan) {
  std::vector<uint32_t>& shared = plan.shared;
  const double total = static_cast<double>(plan.streamed_params);
  const double gpu_pin = 0.5 * plan.gpu_share * total;
  const double cpu_pin = 0.5 * (1 - plan.gpu_share) * total;
  size_t front = 0, back = shared.size();
  for (double acc = 0; front < shared.size() && acc + plan.numel[shared[front]] <= gpu_pin;
       ++front) {
    acc += static_cast<double>(plan.numel[shared[front]]);
  }
  for (double acc = 0; back > front && acc + plan.numel[shared[back - 1]] <= cpu_pin; --back) {
    acc += static_cast<double>(plan.numel[shared[back - 1]]);
  }
  plan.gpu_only.assign(shared.begin(), shared.begin() + front);
  // The CPU pops its own from the front of cpu_only: the far end first.
  plan.cpu_only.assign(shared.rbegin(), shared.rbegin() + (shared.size() - back));
  shared = std::vector<uint32_t>(shared.begin() + front, shared.begin() + back);
}

// Splits the non-resident subgroups between the lists by the policy;
// returns the parameters the policy fixes on the GPU path.
uint64_t PlaceStreamed(StepPlan& plan, bool gpu) {
  uint64_t fixed_gpu_params = 0;
  for (uint32_t i = plan.resident; i < plan.num_subgroups; ++i) {
    plan.streamed_params += plan.numel[i];
    Policy::Kind kind = gpu ? plan.policy.kind : Policy::Kind::kCpu;
    switch (kind) {
      case Policy::Kind::kCpu:
      case Policy::Kind::kStatic: plan.cpu_only.push_back(i); break;
      case Policy::Kind::kInterleave:
        if ((i - plan.resident) % static_cast<uint32_t>(std::max(plan.policy.stride, 1)) == 0) {
          plan.gpu_only.push_back(i);
          fixed_gpu_params += plan.numel[i];
        } else {
          plan.cpu_only.push_back(i);
        }
        break;
      case Policy::Kind::kAuto: plan.shared.push_back(i); break;
    }
  }
  return fixed_gpu_params;
}

// The largest non-resident subgroup (the pipeline's fill and drain).
uint64_t MaxStreamedNumel(const StepPlan& plan) {
  uint64_t m = 0;
  for (uint32_t i = plan.resident; i < plan.num_subgroups; ++i) m = std::max(m, plan.numel[i]);
  return m;
}

// The CPU path's subgroups in the order it takes them: its own, then the
// shared ones from the far end (the delayed path takes this order's head).
std::vector<uint32_t> CpuSideOrder(const StepPlan& plan) {
  std::vector<uint32_t> order = plan.cpu_only;
  order.insert(order.end(), plan.shared.rbegin(), plan.shared.rend());
  return order;
}

}  // namespace

ShardLayout ShardLayout::Of(const ShardState& shard, bool grad_fp32) {
  ShardLayout layout;
  layout.subgroup_numel.reserve(shard.subgroups().size());
  for (const Subgroup& g : shard.subgroups()) layout.subgroup_numel.push_back(g.numel);
  layout.state_bytes = static_cast<double>(shard.bytes_per_param());
  if (!shard.tensors().empty()) {
    const TensorDesc& t0 = shard.tensors()[0];
    layout.grad_bytes = grad_fp32 ? 4.0 : static_cast<double>(DTypeSize(t0.grad_dtype));
    layout.weight_bytes = static_cast<double>(DTypeSize(t0.param_dtype));
  }
  return layout;
}

bool StepPlan::TakeShared(const SubgroupQueue::SharedClaim& claim, size_t in_flight) const {
  const PerfInputs& in = inputs;
  const double n = static_cast<double>(claim.numel);
  const double bytes = in.state_bytes * n;
  // The GPU path's measured throughput as a whole (both copy directions
  // sharing PCIe and host memory with the CPU path) sets its period; the
  // copy-engine rates alone overstate it.
  const double period = gpu_path_rate > 0
                            ? n / gpu_path_rate
                            : bytes / std::min(in.h2d_bytes_per_s, in.d2h_bytes_per_s);
  const double latency =
      bytes / in.h2d_bytes_per_s + n / in.gpu_params_per_s + bytes / in.d2h_bytes_per_s;
  const double inflight = static_cast<double>(in_flight);
  const double gpu_without = inflight * period;
  const double gpu_with = std::max(latency, (inflight + 1) * period);
  // The CPU reaches the shared subgroups only after what it holds already
  // (measured on nvidia-h200 without this term: in a step whose CPU ran
  // slower than its average the GPU declined the last two shared subgroups
  // and idled 77 ms while the CPU worked through them).
  const double cpu_held = static_cast<double>(claim.cpu_left);
  const double cpu_with_gpu =
      (cpu_held + static_cast<double>(claim.shared_left) - n) / cpu_path_rate;
  const double cpu_alone = (cpu_held + static_cast<double>(claim.shared_left)) / cpu_path_rate;
  return std::max(gpu_with, cpu_with_gpu) <= std::max(gpu_without, cpu_alone);
}

StepPlanner::StepPlanner(const PlannerOptions& options)
    : options_(options), sessions_(options.budgets, options.grad_fp32), model_(options.initial) {}

uint32_t StepPlanner::ResidentCount(const Policy& policy, const ShardLayout& layout,
                                    const PlanBudgets& budgets) {
  const uint64_t n = layout.subgroup_numel.size();
  if (!budgets.gpu || n == 0) return 0;
  if (policy.kind == Policy::Kind::kStatic) {
    const double f = std::clamp(policy.fraction, 0.0, 1.0);
    return static_cast<uint32_t>(std::min<uint64_t>(n, std::lround(f * n)));
  }
  if (policy.kind != Policy::Kind::kAuto || budgets.gpu_resident_bytes == 0) return 0;
  // Every resident subgroup is charged the largest one's state: the budget
  // then holds whichever subgroups the count selects.
  const uint64_t sg_bytes = layout.max_subgroup_state_bytes();
  if (sg_bytes == 0) return 0;
  return static_cast<uint32_t>(std::min<uint64_t>(n, budgets.gpu_resident_bytes / sg_bytes));
}

PerfInputs StepPlanner::Capped(const PerfInputs& in, const PlanBudgets& budgets) {
  PerfInputs out = in;
  out.h2d_bytes_per_s = CapAt(in.h2d_bytes_per_s, budgets.pcie_bytes_per_s);
  out.d2h_bytes_per_s = CapAt(in.d2h_bytes_per_s, budgets.pcie_bytes_per_s);
  out.pcie_both_bytes_per_s = CapAt(in.pcie_both_bytes_per_s, 2 * budgets.pcie_bytes_per_s);
  out.host_bytes_per_s = CapAt(in.host_bytes_per_s, budgets.host_bytes_per_s);
  out.host_shared_bytes_per_s = CapAt(in.host_shared_bytes_per_s, budgets.host_bytes_per_s);
  return out;
}

uint32_t StepPlanner::ResidentTarget(const Policy& policy, const ShardLayout& layout,
                                     uint64_t session) const {
  PlanBudgets budgets = options_.budgets;
  budgets.gpu_resident_bytes = sessions_.ResidentBytes(session);
  const bool leased = sessions_.LeaseOf(session).reported;
  const uint32_t count = ResidentCount(policy, layout, budgets);
  if (policy.kind != Policy::Kind::kStatic || !leased || layout.subgroup_numel.empty()) {
    return count;
  }
  // static:<f> within a lease: no more than the lease holds.
  const uint64_t sg_bytes = std::max<uint64_t>(1, layout.max_subgroup_state_bytes());
  return static_cast<uint32_t>(std::min<uint64_t>(count, budgets.gpu_resident_bytes / sg_bytes));
}

StepPlan StepPlanner::Plan(const Policy& policy, const ShardLayout& layout) {
  return PlanWith(policy, layout, ResidentCount(policy, layout, options_.budgets), StepKind(), 0);
}

StepPlan StepPlanner::Plan(const Policy& policy, const ShardLayout& layout, uint32_t resident,
                           StepKind kind, double window_us) {
  const uint32_t n = static_cast<uint32_t>(layout.subgroup_numel.size());
  return PlanWith(policy, layout, options_.budgets.gpu ? std::min(resident, n) : 0, kind,
                  window_us);
}

double StepPlanner::DelayedBudgetParams(const Policy& policy, double window_us) const {
  if (!options_.budgets.gpu || policy.kind != Policy::Kind::kAuto) {
    return std::numeric_limits<double>::infinity();
  }
  PerfInputs in;
  {
    absl::MutexLock lock(&mu_);
    in = model_.inputs();
  }
  return 0.9 * window_us * 1e-6 * DelayedRate(in);
}

uint32_t StepPlanner::DelayedResidentCap(const Policy& policy, const ShardLayout& layout,
                                         double window_us) const {
  const uint32_t n = static_cast<uint32_t>(layout.subgroup_numel.size());
  if (!options_.budgets.gpu || policy.kind != Policy::Kind::kAuto || window_us <= 0) return n;
  const double budget = DelayedBudgetParams(policy, window_us);
  uint32_t cap = n;
  double acc = 0;
  while (cap > 0 && acc + static_cast<double>(layout.subgroup_numel[cap - 1]) <= budget) {
    acc += static_cast<double>(layout.subgroup_numel[--cap]);
  }
  return cap;
}

double StepPlanner::DelayedRate(const PerfInputs& in) const {
  absl::MutexLock lock(&mu_);
  return delayed_rate_ > 0 ? delayed_rate_ : CpuRate(in);
}

void StepPlanner::LearnDelayed(uint64_t params, double update_us) {
  if (params == 0 || update_us <= 0) return;
  absl::MutexLock lock(&mu_);
  delayed_rate_ = Ewma(delayed_rate_, static_cast<double>(params) / (update_us * 1e-6));
}

void StepPlanner::PlaceDelayed(StepPlan& plan, double budget_params) {
  const std::vector<uint32_t> cpu_side = CpuSideOrder(plan);
  double acc = 0;
  size_t taken = 0;
  while (taken < cpu_side.size() &&
         acc + static_cast<double>(plan.numel[cpu_side[taken]]) <= budget_params) {
    acc += static_cast<double>(plan.numel[cpu_side[taken++]]);
  }
  plan.delayed.assign(cpu_side.begin(), cpu_side.begin() + taken);
  for (uint32_t sg : plan.delayed) plan.delayed_params += plan.numel[sg];
  // What the CPU does not take goes to the GPU, in the GPU's order: its own,
  // the shared front to back, then the CPU's leftovers nearest first.
  std::vector<uint32_t> left(cpu_side.begin() + taken, cpu_side.end());
  std::reverse(left.begin(), left.end());
  plan.gpu_only.insert(plan.gpu_only.end(), left.begin(), left.end());
  plan.cpu_only.clear();
  plan.shared.clear();
}

DelayedStepTimes StepPlanner::TimeDelayed(const StepPlan& plan, double streamed, double delayed,
                                          uint64_t max_streamed, double window_s,
                                          double delayed_gpu) const {
  DelayedStepShape shape;
  shape.streamed = streamed;
  shape.resident = static_cast<double>(plan.resident_params);
  shape.delayed = delayed;
  shape.delayed_gpu = delayed_gpu;
  shape.subgroup = static_cast<double>(max_streamed);
  shape.delayed_rate = DelayedRate(plan.inputs);
  shape.window_s = window_s;
  shape.start_at_result = options_.delayed_start_at_result;
  return PerfModel::DelayedStep(plan.inputs, shape);
}

double StepPlanner::AutoDelayedBudget(const StepPlan& plan, double window_us) const {
  if (DelayedRate(plan.inputs) <= 0) return 0;
  const std::vector<uint32_t> cpu_side = CpuSideOrder(plan);
  const uint64_t max_streamed = MaxStreamedNumel(plan);
  // The update starts once the gradients are captured and may run until the
  // trainer's next gradients: through the rest of the GPU path (slowed where
  // the two share host memory) and the window. The most parameters whose
  // update fits 90% of that.
  double best = 0, h = 0;
  for (uint32_t sg : cpu_side) {
    h += static_cast<double>(plan.numel[sg]);
    const DelayedStepTimes t = TimeDelayed(plan, static_cast<double>(plan.streamed_params) - h, h,
                                           max_streamed, window_us * 1e-6);
    if (t.update_s > 0.9 * (window_us * 1e-6 + t.beside_s)) break;
    best = h;
  }
  return best + 0.5;
}

void StepPlanner::PlaceDelayedGpu(StepPlan& plan, double window_us, bool by_window,
                                  bool alone) const {
  // The GPU's delayed update holds the engine's staging slots through the
  // window: only for a session that has the engine to itself (another's
  // step would wait for them).
  if (!options_.delayed_gpu || !options_.budgets.gpu || !alone) return;
  const uint64_t max_streamed = MaxStreamedNumel(plan);
  const double window_s = window_us * 1e-6;
  // The candidates: the GPU path's own, in its order; with delayed_gpu_first
  // then the CPU's delayed ones, the last it would update first.
  std::vector<uint32_t> candidates(plan.gpu_only);
  const size_t own = candidates.size();
  if (options_.delayed_gpu_first) {
    candidates.insert(candidates.end(), plan.delayed.rbegin(), plan.delayed.rend());
  }
  double cpu = static_cast<double>(plan.delayed_params);
  double streamed = static_cast<double>(plan.streamed_params) - cpu;
  double gpu = 0;
  size_t taken = 0;
  for (; taken < candidates.size(); ++taken) {
    const double n = static_cast<double>(plan.numel[candidates[taken]]);
    const double next_cpu = taken < own ? cpu : cpu - n;
    const double next_streamed = taken < own ? streamed - n : streamed;
    if (by_window &&
        TimeDelayed(plan, next_streamed, next_cpu, max_streamed, window_s, gpu + n).gpu_update_s >
            options_.delayed_gpu_window_share * window_s) {
      break;
    }
    gpu += n;
    cpu = next_cpu;
    streamed = next_streamed;
  }
  plan.delayed_gpu.assign(candidates.begin(), candidates.begin() + taken);
  const size_t from_gpu_path = std::min(taken, own);
  plan.gpu_only.erase(plan.gpu_only.begin(), plan.gpu_only.begin() + from_gpu_path);
  // The CPU keeps the front of its list (taken from the back).
  plan.delayed.resize(plan.delayed.size() - (taken - from_gpu_path));
  plan.delayed.insert(plan.delayed.end(), plan.delayed_gpu.begin(), plan.delayed_gpu.end());
  plan.delayed_gpu_params = static_cast<uint64_t>(gpu);
  plan.delayed_params = static_cast<uint64_t>(cpu) + plan.delayed_gpu_params;
}

void StepPlanner::PredictDelayed(StepPlan& plan, uint64_t max_streamed) const {
  const DelayedStepTimes t =
      TimeDelayed(plan, static_cast<double>(plan.streamed_params - plan.delayed_params),
                  static_cast<double>(plan.delayed_params - plan.delayed_gpu_params), max_streamed,
                  plan.window_us * 1e-6, static_cast<double>(plan.delayed_gpu_params));
  plan.predicted_us = (t.step_s + t.overrun_s) * 1e6;
  plan.predicted_iter_us = plan.window_us + plan.predicted_us;
  plan.host_slowdown = t.slowdown;
}

void StepPlanner::OrderFor(StepKind kind, StepPlan& plan) {
  plan.resident_order.resize(plan.resident);
  for (uint32_t i = 0; i < plan.resident; ++i) plan.resident_order[i] = i;
  plan.wait_ready = kind.per_subgroup();
  plan.resident_first = !plan.wait_ready;
  if (!plan.wait_ready) return;
  std::reverse(plan.resident_order.begin(), plan.resident_order.end());
  std::reverse(plan.gpu_only.begin(), plan.gpu_only.end());
  std::reverse(plan.cpu_only.begin(), plan.cpu_only.end());
}

StepPlan StepPlanner::PlanWith(const Policy& policy, const ShardLayout& layout,
                               uint32_t resident, StepKind kind, double window_us) {
  StepPlan plan;
  plan.policy = policy;
  plan.num_subgroups = static_cast<uint32_t>(layout.subgroup_numel.size());
  plan.numel = layout.subgroup_numel;
  plan.max_numel = layout.max_subgroup_numel();
  const PlanBudgets& budgets = options_.budgets;
  plan.resident = resident;
  for (uint32_t i = 0; i < plan.resident; ++i) plan.resident_params += plan.numel[i];
  const uint64_t fixed_gpu_params = PlaceStreamed(plan, budgets.gpu);
  NodeResources* const node = options_.node;
  plan.node_share = node != nullptr ? node->Share(options_.node_engine) : 1.0;
  const bool alone = sessions_.Alone();  // no other session steps on this engine
  {
    absl::MutexLock lock(&mu_);
    model_.set_transfer_sizes(layout.grad_bytes, layout.weight_bytes, layout.state_bytes);
    plan.inputs =
        Capped(node != nullptr ? node->Apply(options_.node_engine, model_.inputs(), plan.node_share)
                               : model_.inputs(),
               budgets);
    plan.cpu_path_rate = cpu_path_rate_ > 0
                             ? cpu_path_rate_
                             : kCpuPathShareOfKernel * CpuRate(plan.inputs);
    plan.gpu_path_rate = gpu_path_rate_;
  }
  // Under auto the budget is the measured window (none yet: this step runs
  // exact); other policies put their CPU subgroups on the host path by rule.
  const bool delayed =
      kind.delays_host() && (window_us > 0 || !budgets.gpu || policy.kind != Policy::Kind::kAuto);
  if (budgets.gpu && policy.kind == Policy::Kind::kAuto) {
    PerfPrediction p = PerfModel::Solve(plan.inputs);
    plan.gpu_share = p.gpu_share;
    plan.binding = p.binding;
    // A delayed step may take any streamed subgroup off the GPU path (what
    // its window has CPU time for): none is pinned to the GPU first.
    if (plan.shared.size() > 2 && !delayed) PinHalfOfEachShare(plan);
  } else {
    plan.gpu_share = plan.streamed_params > 0
                         ? static_cast<double>(fixed_gpu_params) / plan.streamed_params
                         : 0;
    plan.binding = PerfModel::Bound(plan.inputs, plan.gpu_share).binding;
  }
  plan.window_us = window_us;
  if (delayed) {
    const bool by_window = budgets.gpu && policy.kind == Policy::Kind::kAuto;
    PlaceDelayed(plan, by_window ? AutoDelayedBudget(plan, window_us)
                                 : DelayedBudgetParams(policy, window_us));
    PlaceDelayedGpu(plan, window_us, by_window, alone);
  }
  OrderFor(kind, plan);
  const uint64_t max_streamed = MaxStreamedNumel(plan);
  if (delayed && budgets.gpu) {
    PredictDelayed(plan, max_streamed);
  } else {
    plan.predicted_us =
        PerfModel::PhaseSeconds(plan.inputs, plan.gpu_share,
                                static_cast<double>(plan.streamed_params),
                                static_cast<double>(plan.resident_params),
                                static_cast<double>(max_streamed)) * 1e6;
    plan.predicted_iter_us = window_us > 0 ? window_us + plan.predicted_us : 0;
  }
  if (node != nullptr) {
    node->Planned(options_.node_engine, plan.resident_params + plan.streamed_params,
                  plan.node_share, plan.predicted_us, plan.binding);
  }
  return plan;
}

NodeResources::Step StepPlanner::BeginStep(const ShardLayout& layout, uint32_t resident) const {
  if (options_.node == nullptr) return NodeResources::Step();
  uint64_t host_params = 0;
  for (size_t i = resident; i < layout.subgroup_numel.size(); ++i) {
    host_params += layout.subgroup_numel[i];
  }
  return NodeResources::Step(options_.node, options_.node_engine, host_params);
}

double StepPlanner::HostBytes(const StepPlan& plan, const StepMeasurements& m) {
  const double per_cpu_param = 2 * plan.inputs.state_bytes +
                               2 * (plan.inputs.grad_bytes + plan.inputs.weight_bytes);
  // Prefetched state crossed host memory before the phase began: only its
  // way back counts.
  return static_cast<double>(m.cpu_params) * per_cpu_param +
         2.0 * static_cast<double>(m.gpu_h2d_bytes) + static_cast<double>(m.prefetched_bytes);
}

NodeResources::StepEnd StepPlanner::NodeStepEnd(const StepPlan& plan, const StepMeasurements& m) {
  NodeResources::StepEnd end;
  end.share = plan.node_share;
  end.measured_us = m.wall_us;
  end.cpu_params = static_cast<double>(m.cpu_params);
  end.cpu_busy_s = m.cpu_kernel_us * 1e-6;
  end.state_bytes = plan.inputs.state_bytes;
  end.grad_bytes = plan.inputs.grad_bytes;
  end.weight_bytes = plan.inputs.weight_bytes;
  end.host_bytes = HostBytes(plan, m);
  // What the prediction holds apart from host traffic (PhaseSeconds): the
  // pipeline's fill and drain and the resident kernels. The node divides
  // the host bytes by the rest of the update time.
  const uint64_t max_streamed = MaxStreamedNumel(plan);
  end.other_s = PerfModel::PipelineLatencySeconds(plan.inputs, plan.gpu_share,
                                                  static_cast<double>(max_streamed)) +
                (plan.inputs.gpu_params_per_s > 0
                     ? static_cast<double>(plan.resident_params) / plan.inputs.gpu_params_per_s
                     : 0);
  return end;
}

StepPlan StepPlanner::Plan(const Policy& policy, const ShardState& shard) {
  return Plan(policy, ShardLayout::Of(shard, options_.grad_fp32));
}

void StepPlanner::Learn(const StepPlan& plan, const StepMeasurements& m) {
  absl::MutexLock lock(&mu_);
  // With a node view, R_cpu and M_host are the node's: it learns them
  // (NodeStepEnd, from the executor) converted by the plan's share.
  const bool own_host = options_.node == nullptr;
  if (own_host) model_.ObserveCpu(static_cast<double>(m.cpu_params), m.cpu_kernel_us * 1e-6);
  model_.ObserveGpuKernel(static_cast<double>(m.gpu_params), m.gpu_kernel_us * 1e-6);
  model_.ObserveH2d(static_cast<double>(m.gpu_h2d_bytes), m.h2d_us * 1e-6);
  model_.ObserveD2h(static_cast<double>(m.gpu_d2h_bytes), m.d2h_us * 1e-6);
  if (m.cpu_params > 0 && m.cpu_loop_us > 0) {
    cpu_path_rate_ = Ewma(cpu_path_rate_, m.cpu_params / (m.cpu_loop_us * 1e-6));
  }
  // A prefetched subgroup's state came in before the phase: it costs the
  // path about half a streamed one (its way back), so it counts half, or
  // the rate would promise the next, unprefetched subgroups too much.
  const double streamed_work = static_cast<double>(m.streamed_params) -
                               0.5 * static_cast<double>(m.prefetched_params);
  if (streamed_work > 0 && m.gpu_loop_us > 0) {
    gpu_path_rate_ = Ewma(gpu_path_rate_, streamed_work / (m.gpu_loop_us * 1e-6));
  }
  if (own_host && m.cpu_params > 0 && m.gpu_h2d_bytes > 0) {
    model_.ObserveHostTraffic(HostBytes(plan, m), m.wall_us * 1e-6);
  }
  ++steps_;
  if (!options_.budgets.gpu) return;
  uint64_t resident = 0, streamed = 0, cpu = 0;
  for (const TimelineEntry& e : m.entries) (e.path == 'r' ? resident : e.path == 'g' ? streamed : cpu)++;
  DOS_LOG_DEBUG("gpu.step", "policy", FormatPolicy(plan.policy), "measured_us", m.wall_us,
                "predicted_us", plan.predicted_us, "node_share", plan.node_share, "x_model",
                plan.gpu_share, "gpu_subgroups", streamed, "resident", resident, "cpu_subgroups",
                cpu, "binding", plan.binding, "gpu_loop_us", m.gpu_loop_us, "cpu_loop_us",
                m.cpu_loop_us);
  if (!options_.timeline_path.empty()) {
    AppendTimeline(options_.timeline_path,
                   TimelineLine(steps_, plan.policy, m.wall_us, plan.predicted_us, m.entries));
  }
}

PerfInputs StepPlanner::model_inputs() const {
  PerfInputs in;
  {
    absl::MutexLock lock(&mu_);
    in = model_.inputs();
  }
  // R_cpu and M_host: the node's whole (not a share) when there is a node.
  return options_.node != nullptr ? options_.node->Apply(options_.node_engine, in, 1.0) : in;
}

double StepPlanner::cpu_path_rate() const {
  absl::MutexLock lock(&mu_);
  return cpu_path_rate_;
}

double StepPlanner::gpu_path_rate() const {
  absl::MutexLock lock(&mu_);
  return gpu_path_rate_;
}

}  // namespace dos
