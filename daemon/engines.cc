#include "daemon/engines.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#ifdef DOS_WITH_CUDA
#include "daemon/gpu/gpu_engine.h"
#endif

namespace dos {

namespace {

// The delayed update's updater: the step's options with its thread count
// (EnginesConfig::delayed_cpu_threads) from the step updater's `threads`.
cpu::CpuUpdaterOptions DelayedUpdaterOptions(const EnginesConfig& config, int threads) {
  cpu::CpuUpdaterOptions delayed = config.cpu;
  const int n = config.delayed_cpu_threads;
  delayed.threads = n > 0 ? n : std::max(1, threads + std::min(n, 0));
  delayed.worker_nice = config.delayed_cpu_nice;
  return delayed;
}

}  // namespace

Engines::Engines(const EnginesConfig& config)
    : cpu_updater_(config.cpu),
      delayed_updater_(DelayedUpdaterOptions(config, cpu_updater_.threads())),
      host_engine_(&cpu_updater_, &delayed_updater_),
      executors_(&host_engine_) {}

Engines::~Engines() = default;

absl::StatusOr<std::unique_ptr<Engines>> Engines::Create(const EnginesConfig& config) {
  std::unique_ptr<Engines> engines(new Engines(config));
  if (absl::Status st = engines->AddGpuEngines(config); !st.ok()) return st;
  return engines;
}

#ifdef DOS_WITH_CUDA
// One GPU engine per device --gpu_devices names, each with the executor (and
// planner) over it.
absl::Status Engines::AddGpuEngines(const EnginesConfig& config) {
  absl::StatusOr<std::vector<int>> ordinals =
      ResolveGpuDevices(config.gpu_devices, gpu::GpuEngine::VisibleDevices());
  if (!ordinals.ok() && ordinals.status().code() == absl::StatusCode::kUnavailable) {
    DOS_LOG_INFO("daemon.cpu_only", "reason", ordinals.status().message());
    ordinals = std::vector<int>();
  }
  if (!ordinals.ok()) return ordinals.status();
  for (int ordinal : *ordinals) {
    gpu::GpuEngineOptions gopt;
    gopt.device = ordinal;
    gopt.staging_slots = config.gpu_staging_slots;
    gopt.prefetch = config.gpu_prefetch;
    gopt.cpu_grad_fp32 = config.gpu_cpu_grad_fp32;
    gopt.cpu_copy_kernel = config.gpu_cpu_copy_kernel;
    gopt.delayed_kernel_blocks = config.delayed_gpu_kernel_blocks;
    gopt.delayed_staged = config.delayed_gpu_staged;
    PlannerOptions planner;
    if (config.model_host_gbps > 0) {
      planner.initial.host_bytes_per_s = config.model_host_gbps * 1e9;
      planner.initial.host_shared_bytes_per_s = config.model_host_gbps * 1e9;
    }
    planner.budgets.gpu_resident_bytes = config.gpu_memory_budget;
    planner.budgets.staging_slots = static_cast<uint32_t>(config.gpu_staging_slots);
    planner.budgets.staging_io = config.delayed_gpu_staged;
    planner.grad_fp32 = config.gpu_cpu_grad_fp32;
    planner.delayed_start_at_result = config.delayed_start_at_result;
    planner.delayed_handoff = config.delayed_handoff;
    planner.delayed_gpu = config.delayed_gpu || config.delayed_gpu_first;
    planner.delayed_gpu_first = config.delayed_gpu_first;
    planner.delayed_gpu_window_share = config.delayed_gpu_window_share;
    // Several engines write a file each (a step's line is too long to append
    // atomically beside another engine's).
    planner.timeline_path = config.gpu_timeline.empty() || ordinals->size() == 1
                                ? config.gpu_timeline
                                : absl::StrCat(config.gpu_timeline, ".cuda", ordinal);
    absl::StatusOr<std::unique_ptr<gpu::GpuEngine>> engine =
        gpu::GpuEngine::Create(gopt, &cpu_updater_, &delayed_updater_);
    if (engine.ok()) {
      executors_.AddGpu(GpuDeviceInfo{ordinal, (*engine)->device_uuid(), (*engine)->device_name()},
                        engine->get(), planner);
      gpu_engines_.push_back(*std::move(engine));
    } else if (engine.status().code() == absl::StatusCode::kUnavailable) {
      DOS_LOG_INFO("daemon.cpu_only", "reason", engine.status().message());
    } else {
      return engine.status();
    }
  }
  return absl::OkStatus();
}
#else
absl::Status Engines::AddGpuEngines(const EnginesConfig&) { return absl::OkStatus(); }
#endif

}  // namespace dos
