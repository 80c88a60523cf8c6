#include "daemon/sched/perf_model.h"

#include <algorithm>
#include <limits>

namespace dos {

PerfPrediction PerfModel::Bound(const PerfInputs& in, double x) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double c = 1.0 - x;
  const double g = in.grad_bytes;
  const double w = in.weight_bytes;
  const double st = in.state_bytes;
  struct Limit {
    const char* name;
    double rate;
  };
  auto rate = [](double capacity, double per_param) {
    return per_param > 0 ? capacity / per_param : std::numeric_limits<double>::infinity();
  };
  const Limit limits[] = {
      {"cpu", rate(CpuRate(in), c)},
      {"d2h", rate(in.d2h_bytes_per_s, c * g + st * x)},
      {"h2d", rate(in.h2d_bytes_per_s, c * w + st * x)},
      {"pcie_both", rate(in.pcie_both_bytes_per_s, c * (g + w) + 2 * st * x)},
      {"host_memory", rate(in.host_bytes_per_s, c * (2 * st + 2 * (g + w)) + 2 * st * x)},
      {"gpu_kernel", rate(in.gpu_params_per_s, x)},
  };
  PerfPrediction p;
  p.gpu_share = x;
  p.params_per_s = kInf;
  for (const Limit& l : limits) {
    if (l.rate < p.params_per_s) {
      p.params_per_s = l.rate;
      p.binding = l.name;
    }
  }
  return p;
}

PerfPrediction PerfModel::Solve(const PerfInputs& in) {
  PerfPrediction best = Bound(in, 0.0);
  for (int i = 1; i <= 1000; ++i) {
    PerfPrediction p = Bound(in, i / 1000.0);
    if (p.params_per_s > best.params_per_s) best = p;
  }
  return best;
}

double PerfModel::PipelineLatencySeconds(const PerfInputs& in, double x, double subgroup) {
  if (subgroup <= 0) return 0;
  if (x > 0) return in.state_bytes * subgroup / std::min(in.h2d_bytes_per_s, in.d2h_bytes_per_s);
  return subgroup * (in.grad_bytes / in.d2h_bytes_per_s + in.weight_bytes / in.h2d_bytes_per_s);
}

double PerfModel::PhaseSeconds(const PerfInputs& in, double x, double streamed,
                               double resident, double subgroup) {
  double t = 0;
  if (streamed > 0) {
    t = streamed / Bound(in, x).params_per_s + PipelineLatencySeconds(in, x, subgroup);
  }
  // The resident kernels share the compute engine with the streamed GPU
  // share's kernels; they are fast enough that adding them is the honest
  // upper estimate.
  if (resident > 0) t += resident / in.gpu_params_per_s;
  return t;
}

DelayedStepTimes PerfModel::DelayedStep(const PerfInputs& in, const DelayedStepShape& shape) {
  DelayedStepTimes t;
  const double gpu_alone_s = PhaseSeconds(in, 1.0, shape.streamed, shape.resident, shape.subgroup);
  const double captured = shape.delayed + shape.delayed_gpu;
  const double capture_s =
      in.d2h_bytes_per_s > 0 ? captured * in.grad_bytes / in.d2h_bytes_per_s : 0;
  // The previous update's weights go back H2D during the step.
  const double install_s =
      in.h2d_bytes_per_s > 0 ? captured * in.weight_bytes / in.h2d_bytes_per_s : 0;
  double update_s = shape.delayed_rate > 0 ? shape.delayed / shape.delayed_rate : 0;
  // The GPU's delayed subgroups: state and gradients in, state and weights
  // out, in the window. Beside the CPU update both share host memory (the
  // same f as below, over their overlap).
  if (shape.delayed_gpu > 0 && in.h2d_bytes_per_s > 0 && in.d2h_bytes_per_s > 0) {
    const double per_param_s = std::max((in.state_bytes + in.grad_bytes) / in.h2d_bytes_per_s,
                                        (in.state_bytes + in.weight_bytes) / in.d2h_bytes_per_s);
    t.gpu_update_s = shape.delayed_gpu * per_param_s;
    if (update_s > 0 && in.host_shared_bytes_per_s > 0) {
      const double demand = (2 * in.state_bytes + in.grad_bytes + in.weight_bytes) / per_param_s +
                            shape.delayed_rate * CpuKernelBytes(in, in.state_bytes);
      const double extra = std::min(update_s, t.gpu_update_s) *
                           (std::max(1.0, demand / in.host_shared_bytes_per_s) - 1);
      update_s += extra;
      t.gpu_update_s += extra;
    }
  }
  t.update_s = update_s;
  double stretch_s = 0;
  if (!shape.start_at_result && shape.streamed > 0 && update_s > 0 &&
      in.host_shared_bytes_per_s > 0) {
    const double path_rate = Bound(in, 1.0).params_per_s;
    const double demand =
        path_rate * 2 * in.state_bytes + shape.delayed_rate * CpuKernelBytes(in, in.state_bytes);
    t.slowdown = std::max(1.0, demand / in.host_shared_bytes_per_s);
    const double overlap_s =
        std::min({update_s, shape.streamed / path_rate, std::max(0.0, gpu_alone_s - capture_s)});
    stretch_s = overlap_s * (t.slowdown - 1);
  }
  t.step_s = std::max({gpu_alone_s + stretch_s, capture_s, install_s});
  const double start_s = shape.start_at_result ? t.step_s : capture_s;
  t.beside_s = t.step_s - start_s;
  // The GPU's part starts at the result (the step holds the staging slots).
  t.overrun_s =
      std::max({0.0, update_s - t.beside_s - shape.window_s, t.gpu_update_s - shape.window_s});
  return t;
}

void PerfModel::Ewma(double* value, double sample) {
  *value = (1 - kAlpha) * *value + kAlpha * sample;
}

void PerfModel::ObserveCpu(double params, double busy_s) {
  if (params > 0 && busy_s > 0) {
    const double fp32_equivalent =
        params * CpuKernelBytes(in_, in_.state_bytes) / CpuKernelBytes(in_, 12);
    Ewma(&in_.cpu_params_per_s, fp32_equivalent / busy_s);
  }
}
void PerfModel::ObserveGpuKernel(double params, double busy_s) {
  if (params > 0 && busy_s > 0) Ewma(&in_.gpu_params_per_s, params / busy_s);
}
void PerfModel::ObserveH2d(double bytes, double busy_s) {
  if (bytes > 0 && busy_s > 0) Ewma(&in_.h2d_bytes_per_s, bytes / busy_s);
}
void PerfModel::ObserveD2h(double bytes, double busy_s) {
  if (bytes > 0 && busy_s > 0) Ewma(&in_.d2h_bytes_per_s, bytes / busy_s);
}
void PerfModel::ObserveHostTraffic(double bytes, double wall_s) {
  if (bytes > 0 && wall_s > 0) in_.host_bytes_per_s = std::max(in_.host_bytes_per_s, bytes / wall_s);
}

}  // namespace dos
