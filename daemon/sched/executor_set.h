// ExecutorSet: the step executors of one daemon, one per GPU engine plus one
// for host-memory (shared-memory) sessions, and the choice between them.
//
// One dosd serves every rank of a node, and each rank's CUDA memory lives on
// its own GPU; CUDA IPC maps memory only on the device it lives on, so a
// session's steps run on the engine of that device. Register picks it from the
// device UUID of the session's tensors (ForDeviceUuid); sessions whose
// tensors are in shared memory run on host(), over the host engine. All
// engines share the daemon's one CPU updater (its thread pool), and the GPU
// executors' planners one view of the host's memory bandwidth and cores
// (node()), split between the engines stepping at the same time.
//
// Every engine is injected (the composition root, main.cc, builds the host
// engine and the GPU engines): sched/ knows engines only through engine.h,
// so it does not depend on cpu/'s host engine nor gpu/.
//
// Ownership: the set owns its executors (each with its planner); every
// engine is owned by the caller and outlives the set. The set outlives every
// session.
// Thread-safety: AddGpu is called during start-up only, before any session
// exists; every other method is const and thread-safe.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/sched/device_selection.h"
#include "daemon/sched/engine.h"
#include "daemon/sched/node_resources.h"
#include "daemon/sched/step_planner.h"
#include "daemon/sched/step_executor.h"

namespace dos {

class ExecutorSet {
 public:
  // One GPU device and the executor over its engine.
  struct Device {
    GpuDeviceInfo device;
    StepExecutor* executor = nullptr;
  };

  // `host_engine`: the engine of host-memory sessions (cpu::HostEngine in
  // dosd; its has_gpu() is false).
  explicit ExecutorSet(Engine* host_engine);
  ExecutorSet(const ExecutorSet&) = delete;
  ExecutorSet& operator=(const ExecutorSet&) = delete;

  // Adds the engine driving `device` and its executor, whose planner is made
  // with `planner` and this set's node view (start-up only; the first GPU's
  // planner.initial seeds the node's R_cpu and M_host).
  void AddGpu(GpuDeviceInfo device, Engine* engine, const PlannerOptions& planner = {});

  // The executor of host-memory sessions (the host engine: every step on the CPU).
  StepExecutor* host() const { return host_.get(); }
  // The engine of the device whose UUID (raw or text) is `uuid`;
  // FAILED_PRECONDITION as MatchDeviceUuid describes otherwise.
  absl::StatusOr<Device> ForDeviceUuid(absl::string_view uuid, absl::string_view what) const;

  std::span<const GpuDeviceInfo> devices() const { return devices_; }
  // The GPU engines' shared view of the host (node_resources.h); engine i of
  // the node is devices()[i].
  const NodeResources& node() const { return node_; }
  NodeResources& node() { return node_; }
  bool has_gpu() const { return !devices_.empty(); }

 private:
  NodeResources node_;  // before the executors whose planners point to it
  std::unique_ptr<StepExecutor> host_;
  std::vector<GpuDeviceInfo> devices_;                    // parallel to gpu_
  std::vector<std::unique_ptr<StepExecutor>> gpu_;
};

}  // namespace dos
