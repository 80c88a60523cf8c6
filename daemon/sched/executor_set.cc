#include "daemon/sched/executor_set.h"

#include <utility>

namespace dos {

ExecutorSet::ExecutorSet(cpu::CpuUpdater* cpu)
    : cpu_(cpu), host_(std::make_unique<StepExecutor>(cpu)) {}

void ExecutorSet::AddGpu(GpuDeviceInfo device, GpuBackend* engine) {
  devices_.push_back(std::move(device));
  gpu_.push_back(std::make_unique<StepExecutor>(cpu_, engine));
}

absl::StatusOr<ExecutorSet::Engine> ExecutorSet::ForDeviceUuid(absl::string_view uuid,
                                                               absl::string_view what) const {
  absl::StatusOr<size_t> i = MatchDeviceUuid(devices_, uuid, what);
  if (!i.ok()) return i.status();
  return Engine{devices_[*i], gpu_[*i].get()};
}

}  // namespace dos
