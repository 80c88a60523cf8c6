// PerfModel: the update-phase performance model of DESIGN.md section 4.
//
// For a GPU share x of the non-resident parameters and a step rate r
// (params/s), every resource must keep up:
//   CPU kernel   (1-x) r                      <= R_cpu(s)
//   D2H          r [(1-x) g + s x]            <= B_d2h
//   H2D          r [(1-x) w + s x]            <= B_h2d
//   PCIe total   r [(1-x)(g+w) + 2s x]        <= B_both
//   host memory  r [(1-x) c + 2s x]           <= M_host
//   GPU kernel   x r                          <= R_gpu
// where s is the session's bytes of state per parameter (12 for fp32 state,
// 8 for compact state: StateFormat), g / w the gradient / weight bytes the
// CPU path moves per parameter (2 for 16-bit) and c = 2s + 2(g + w) the
// host-memory bytes one CPU-path parameter costs (the kernel's s read + s
// written of state, the gradient and weight once by the kernel and once by
// the DMA engine: 32 for bf16 with fp32 state, 24 with compact). The GPU path
// costs 2s host bytes (s read by H2D, s written by D2H).
//
// The CPU kernel is bound by memory traffic, so its rate scales with its
// bytes per parameter k(s) = 2s + g + w (28 fp32, 20 compact, for bf16):
// R_cpu is kept as the fp32-state rate and R_cpu(s) = R_cpu k(12) / k(s);
// measurements of either format are converted into it (ObserveCpu), so
// sessions of both formats on one engine teach one figure. Resident parameters (static share, or auto with a GPU memory
// budget) cost only GPU kernel time. Bound(x) is the largest r meeting all
// constraints; Solve() maximises it over x by a fine grid (the function is
// piecewise monotone, a grid of 1/1000 is exact enough and cheap).
//
// Rates are measured online from each step's timings and smoothed (EWMA);
// until measured they hold the figures of DESIGN.md section 7 for the
// machine class DOS targets (an H200 node), which the first steps replace.
//
// Thread-safety: none; the GPU engine owns one per device and uses it from
// the step being run (steps of one device are serialised by the engine).
#pragma once

#include <string>

namespace dos {

struct PerfInputs {
  double cpu_params_per_s = 4.0e9;   // R_cpu: CPU kernel alone
  double gpu_params_per_s = 100e9;   // R_gpu: fused GPU kernel
  double h2d_bytes_per_s = 50e9;     // B_h2d, pinned
  double d2h_bytes_per_s = 50e9;     // B_d2h, pinned
  double pcie_both_bytes_per_s = 95e9;  // B_both: both directions at once, in total
  double host_bytes_per_s = 145e9;   // M_host: cores and DMA engines together
  // M_host as seeded (the probe's figure, --model_host_gbps), never learned:
  // what the delayed update and the streamed path share (DelayedStep). The
  // learned M_host above is the model's effective figure: it divides a
  // step's bytes by its time less the resident kernels, which the host's
  // traffic overlaps, and rose to 200-273 GB/s on nvidia-h200 (probe: 168).
  double host_shared_bytes_per_s = 145e9;
  double grad_bytes = 2;             // g
  double weight_bytes = 2;           // w
  double state_bytes = 12;           // s: 12 fp32 state, 8 compact
};

// Bytes of memory traffic the CPU kernel causes per parameter: k(s).
inline double CpuKernelBytes(const PerfInputs& in, double state_bytes) {
  return 2 * state_bytes + in.grad_bytes + in.weight_bytes;
}
// R_cpu(s): the CPU kernel's rate for the inputs' state bytes.
inline double CpuRate(const PerfInputs& in) {
  return in.cpu_params_per_s * CpuKernelBytes(in, 12) / CpuKernelBytes(in, in.state_bytes);
}

// A delayed step (issue 23) after its verdict: `streamed` parameters cross
// PCIe on the GPU path, `resident` are updated in GPU memory, and `delayed`
// parameters' gradients are captured (D2H) for an update on the CPU at
// `delayed_rate` params/s that may run until the next step's verdict, which
// comes `window_s` after this step's result.
struct DelayedStepShape {
  double streamed = 0;
  double resident = 0;
  double delayed = 0;
  // Captured and installed like `delayed`, updated on the GPU during the
  // window: their state crosses PCIe both ways then (--delayed_gpu_path).
  double delayed_gpu = 0;
  double subgroup = 0;  // the largest streamed subgroup (fill and drain)
  double delayed_rate = 0;
  double window_s = 0;
  bool start_at_result = false;  // the update starts at the result, not after the capture
};
struct DelayedStepTimes {
  double step_s = 0;     // verdict to result: the GPU path, the captures and installs
  double overrun_s = 0;  // the delayed update's time past the next verdict (the trainer waits)
  double update_s = 0;   // the update's own time (delayed / delayed_rate)
  double beside_s = 0;   // of step_s, the time the update runs beside the step
  double slowdown = 1;   // f: both host-memory users' stretch while they overlap
  double gpu_update_s = 0;  // delayed_gpu's transfers in the window (0: none)
};

struct PerfPrediction {
  double gpu_share = 0;      // x
  double params_per_s = 0;   // r over the non-resident parameters
  std::string binding;       // the constraint that limits r ("host_memory", "pcie", ...)
};

class PerfModel {
 public:
  explicit PerfModel(const PerfInputs& initial = PerfInputs()) : in_(initial) {}

  // r at a fixed GPU share x in [0, 1].
  static PerfPrediction Bound(const PerfInputs& in, double x);
  // The x that maximises r.
  static PerfPrediction Solve(const PerfInputs& in);
  // Predicted phase seconds for `streamed` params split at share x plus
  // `resident` params updated in GPU memory (their kernel time overlaps the
  // streamed work on other engines but shares the compute stream), plus the
  // pipeline's fill and drain for subgroups of `subgroup` params (0: none):
  // a path's first inbound copy and last outbound copy overlap nothing of
  // that path. With a GPU share, one subgroup's state crossing PCIe (the
  // first H2D and last D2H of s bytes/param, the other side working
  // meanwhile: about one of the two is exposed); CPU only, the first
  // gradient D2H and the last weight H2D.
  static double PhaseSeconds(const PerfInputs& in, double x, double streamed, double resident,
                             double subgroup = 0);
  // A delayed step's times. The update starts once its gradients are
  // captured (or at the result) and runs beside the rest of the GPU path,
  // then the window. While it runs beside the streamed transfers the two
  // share host memory: the DMA engines want 2s bytes per streamed parameter
  // at the path's rate, the cores k(s) per delayed parameter at
  // delayed_rate, and when that is more than M_host (host_shared_bytes_per_s)
  // both slow by f = demand / M_host (DESIGN.md section 7: 104 + 92 GB/s
  // alone, 145 together; f 1.35). The streamed part is stretched by f - 1 for as long as
  // they overlap; the update's own stretch is already in delayed_rate, which
  // is measured in such steps.
  static DelayedStepTimes DelayedStep(const PerfInputs& in, const DelayedStepShape& shape);
  // The fill/drain term of PhaseSeconds alone.
  static double PipelineLatencySeconds(const PerfInputs& in, double x, double subgroup);

  // EWMA updates from one step's measurements (each ignored when its
  // denominator is 0). alpha is the weight of the new sample. ObserveCpu's
  // params were updated with the current inputs' state_bytes (converted to
  // the fp32-state rate R_cpu keeps).
  void ObserveCpu(double params, double busy_s);
  void ObserveGpuKernel(double params, double busy_s);
  void ObserveH2d(double bytes, double busy_s);
  void ObserveD2h(double bytes, double busy_s);
  // Host bytes moved by cores and DMA together over a wall time in which
  // both were busy: raises M_host when more was seen than assumed.
  void ObserveHostTraffic(double bytes, double wall_s);
  void set_transfer_sizes(double grad_bytes, double weight_bytes, double state_bytes = 12) {
    in_.grad_bytes = grad_bytes;
    in_.weight_bytes = weight_bytes;
    in_.state_bytes = state_bytes;
  }

  const PerfInputs& inputs() const { return in_; }

 private:
  static constexpr double kAlpha = 0.3;
  static void Ewma(double* value, double sample);
  PerfInputs in_;
};

}  // namespace dos
