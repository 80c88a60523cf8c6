#include "daemon/sched/executor_set.h"

#include <utility>

namespace dos {

ExecutorSet::ExecutorSet(cpu::CpuUpdater* cpu)
    : host_engine_(cpu), host_(std::make_unique<StepExecutor>(&host_engine_)) {}

void ExecutorSet::AddGpu(GpuDeviceInfo device, Engine* engine, const PlannerOptions& planner) {
  devices_.push_back(std::move(device));
  gpu_.push_back(std::make_unique<StepExecutor>(engine, planner));
}

absl::StatusOr<ExecutorSet::Device> ExecutorSet::ForDeviceUuid(absl::string_view uuid,
                                                               absl::string_view what) const {
  absl::StatusOr<size_t> i = MatchDeviceUuid(devices_, uuid, what);
  if (!i.ok()) return i.status();
  return Device{devices_[*i], gpu_[*i].get()};
}

}  // namespace dos
