// What the planner and performance-model tests share: the H200 figures of
// DESIGN.md section 7, uniform layouts and a GPU engine's planner options.
#pragma once

#include <cstdint>

#include "daemon/sched/perf_model.h"
#include "daemon/sched/step_planner.h"

namespace dos::testing {

// One H200 host's rates (DESIGN.md section 7).
inline PerfInputs H200Rates() {
  PerfInputs in;
  in.cpu_params_per_s = 3.7e9;
  in.gpu_params_per_s = 120e9;
  in.h2d_bytes_per_s = 55e9;
  in.d2h_bytes_per_s = 55e9;
  in.pcie_both_bytes_per_s = 97e9;
  in.host_bytes_per_s = 145e9;
  return in;
}

// `n` subgroups of `numel` parameters, `state_bytes` of state each (12: fp32
// state, 8: compact).
inline ShardLayout UniformLayout(uint32_t n, uint64_t numel, double state_bytes = 12) {
  ShardLayout l;
  l.subgroup_numel.assign(n, numel);
  l.state_bytes = state_bytes;
  return l;
}

// A GPU engine's planner on H200 rates, `resident_bytes` of resident budget.
inline PlannerOptions GpuPlannerOptions(uint64_t resident_bytes = 0) {
  PlannerOptions o;
  o.budgets.gpu = true;
  o.budgets.gpu_resident_bytes = resident_bytes;
  o.initial = H200Rates();
  return o;
}

}  // namespace dos::testing
