#include "daemon/rpc/step_stats.h"

namespace dos {

void FillStepStats(const StepOutcome& o, double last_wall_us, v1::StepStats* last) {
  last->set_step(static_cast<uint64_t>(o.step));
  last->set_skipped(o.found_inf);
  last->set_wall_us(last_wall_us);
  last->set_cpu_us(o.update_us);
  last->set_cpu_subgroups(o.cpu_subgroups);
  last->set_gpu_subgroups(o.gpu_subgroups);
  if (o.cpu_busy_us > 0 || o.gpu_busy_us > 0) last->set_cpu_us(o.cpu_busy_us);
  last->set_gpu_us(o.gpu_busy_us);
  last->set_h2d_bytes(o.h2d_bytes);
  last->set_d2h_bytes(o.d2h_bytes);
  last->set_predicted_us(o.predicted_us);
  last->set_update_us(o.update_us);
  last->set_resident_subgroups(o.resident_subgroups);
  last->set_cpu_params(o.cpu_params);
  last->set_gpu_params(o.gpu_params);
  const double secs = o.update_us * 1e-6;
  if (secs > 0) {
    last->set_h2d_gbps(static_cast<double>(o.h2d_bytes) / secs * 1e-9);
    last->set_d2h_gbps(static_cast<double>(o.d2h_bytes) / secs * 1e-9);
    last->set_cpu_busy(o.cpu_busy_us / o.update_us);
    last->set_gpu_busy(o.gpu_busy_us / o.update_us);
    last->set_h2d_busy(o.h2d_busy_us / o.update_us);
    last->set_d2h_busy(o.d2h_busy_us / o.update_us);
  }
  last->set_model_gpu_share(o.model_gpu_share);
  last->set_model_binding(o.model_binding);
  last->set_early(o.early);
  last->set_before_verdict_us(o.before_verdict_us);
  last->set_after_verdict_us(o.after_verdict_us);
  last->set_prefetched_bytes(o.prefetched_bytes);
  last->set_gpu_memory_bytes(o.gpu_memory_bytes);
  last->set_gpu_lease_bytes(o.gpu_lease_bytes);
  last->set_trainer_gpu_budget_bytes(o.trainer_gpu_budget_bytes);
  last->set_trainer_gpu_peak_bytes(o.trainer_gpu_peak_bytes);
  last->set_resident_budget_bytes(o.resident_budget_bytes);
  last->set_node_share(o.node_share);
}

}  // namespace dos
