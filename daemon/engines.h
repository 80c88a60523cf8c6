// Engines: the engines of one dosd and the executors over them. Part of the
// composition root (main.cc builds one; its own file so that main.cc stays
// within the structure test's file size): two CPU updaters (thread pools)
// that every engine shares, the step's and the delayed update's, the host
// engine of shared-memory sessions, and one GPU engine (streams, staging,
// performance model) per device that --gpu_devices names, each injected
// into the ExecutorSet (sched/ depends on no engine implementation).
//
// Ownership: Engines owns all of them; it outlives the SessionManager that
// uses executors(). Members are built in declaration order and destroyed in
// reverse (the GPU engines first). Thread-safety: Create() on main's thread
// during start-up; the accessors are thread-safe afterwards.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/sched/device_selection.h"
#include "daemon/sched/executor_set.h"

namespace dos {

namespace gpu {
class GpuEngine;
}  // namespace gpu

// The engines' part of dosd's configuration, one field per flag.
struct EnginesConfig {
  cpu::CpuUpdaterOptions cpu;        // update threads, tile, ISA
  // The delayed update's threads (delay=1: it runs beside the trainers'
  // forward and backward, whose launch threads need cores): > 0 that many;
  // 0 as `cpu`; -K `cpu`'s count less K (at least 1).
  int delayed_cpu_threads = -2;
  // Their workers' nice value (CpuUpdaterOptions::worker_nice).
  int delayed_cpu_nice = 0;
  // The delayed update starts after the step's result, not at its capture
  // (PlannerOptions::delayed_start_at_result).
  bool delayed_start_at_result = false;
  // --delayed_handoff (PlannerOptions::delayed_handoff).
  bool delayed_handoff = false;
  // --delayed_gpu_path (PlannerOptions::delayed_gpu).
  bool delayed_gpu = false;
  // --delayed_gpu_first (PlannerOptions::delayed_gpu_first; implies delayed_gpu).
  bool delayed_gpu_first = false;
  // --delayed_gpu_window_share (PlannerOptions::delayed_gpu_window_share).
  double delayed_gpu_window_share = 0.9;
  // --delayed_gpu_kernel_blocks (GpuEngineOptions::delayed_kernel_blocks).
  uint32_t delayed_gpu_kernel_blocks = 0;
  // --delayed_gpu_staged (GpuEngineOptions::delayed_staged, PlanBudgets::staging_io).
  bool delayed_gpu_staged = false;
  GpuDeviceSelection gpu_devices;    // devices that get a GPU engine
  uint64_t gpu_memory_budget = 0;    // resident-state bytes `auto` may use on the GPU
  int gpu_staging_slots = 2;         // GPU-path subgroups in flight
  bool gpu_prefetch = false;         // state into the slots before the verdict
  double model_host_gbps = 0;        // M_host for the performance model; 0 = built-in
  bool gpu_cpu_grad_fp32 = false;    // CPU path sends fp32 gradients (measurement)
  bool gpu_cpu_copy_kernel = true;   // CPU path copies by kernel (false: copy engines)
  std::string gpu_timeline;          // per-step placement log; empty: off
};

class Engines {
 public:
  // The CPU updater, the host engine and (built with CUDA) one GPU engine per
  // device; no device at all is not an error (logged daemon.cpu_only: the
  // daemon runs CPU only). The error of a device that fails otherwise.
  static absl::StatusOr<std::unique_ptr<Engines>> Create(const EnginesConfig& config);
  ~Engines();
  Engines(const Engines&) = delete;
  Engines& operator=(const Engines&) = delete;

  const cpu::CpuUpdater& cpu_updater() const { return cpu_updater_; }
  const cpu::CpuUpdater& delayed_updater() const { return delayed_updater_; }
  ExecutorSet* executors() { return &executors_; }
  const ExecutorSet& executors() const { return executors_; }

 private:
  explicit Engines(const EnginesConfig& config);
  absl::Status AddGpuEngines(const EnginesConfig& config);

  cpu::CpuUpdater cpu_updater_;
  cpu::CpuUpdater delayed_updater_;
  cpu::HostEngine host_engine_;
  ExecutorSet executors_;
#ifdef DOS_WITH_CUDA  // dosd's compile definition
  std::vector<std::unique_ptr<gpu::GpuEngine>> gpu_engines_;
#endif
};

}  // namespace dos
