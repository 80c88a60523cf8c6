#include "daemon/sched/executor_set.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dos {

ExecutorSet::ExecutorSet(Engine* host_engine)
    : host_(std::make_unique<StepExecutor>(host_engine)) {}

void ExecutorSet::AddGpu(GpuDeviceInfo device, Engine* engine, const PlannerOptions& planner) {
  PlannerOptions with_node = planner;
  with_node.node = &node_;
  with_node.node_engine = node_.AddEngine(absl::StrCat("cuda:", device.ordinal), planner.initial);
  devices_.push_back(std::move(device));
  gpu_.push_back(std::make_unique<StepExecutor>(engine, std::move(with_node)));
}

absl::StatusOr<ExecutorSet::Device> ExecutorSet::ForDeviceUuid(absl::string_view uuid,
                                                               absl::string_view what) const {
  absl::StatusOr<size_t> i = MatchDeviceUuid(devices_, uuid, what);
  if (!i.ok()) return i.status();
  return Device{devices_[*i], gpu_[*i].get()};
}

}  // namespace dos
