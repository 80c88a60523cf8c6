// HostEngine: the engine of sessions whose tensors live in shared memory
// (CPU mode, what CI runs end to end): every subgroup on the CPU updater,
// the trainer's weights written in place in its dtype.
//
// Ownership: owns nothing but pointers to the daemon's CPU updaters (the
// step's, and the delayed update's: fewer threads, as it runs beside the
// trainers' forward and backward), which outlive it. Thread-safety:
// thread-safe (the updaters are).
#pragma once

#include <memory>
#include <span>
#include <string>

#include "daemon/cpu/cpu_updater.h"
#include "daemon/sched/engine.h"

namespace dos::cpu {

class HostEngine final : public Engine {
 public:
  // `delayed`: the delayed update's updater; null: `cpu`.
  explicit HostEngine(CpuUpdater* cpu, CpuUpdater* delayed = nullptr)
      : cpu_(cpu), delayed_cpu_(delayed != nullptr ? delayed : cpu) {}

  bool has_gpu() const override { return false; }
  bool host_addressable() const override { return true; }
  std::string name() const override { return "host"; }
  std::unique_ptr<Transport> NewTransport() override;
  absl::Status AttachShard(ShardState&, RegisterProgress*) override { return absl::OkStatus(); }
  absl::StatusOr<void*> OpenTrainerEvent(const std::string& handle) override;
  void CloseTrainerEvent(void*) override {}
  absl::Status WaitTrainerEvent(void* event) override;
  absl::Status SyncTrainerEvent(void* event) override;
  absl::Status CopyToHost(void* dst, const void* trainer_src, uint64_t bytes) override;
  absl::Status CopyToTrainer(void* trainer_dst, const void* src, uint64_t bytes) override;
  absl::StatusOr<bool> AllFinite(const ShardState& shard,
                                 std::span<const TensorBinding> bindings) override;
  // Every subgroup of `plan` must be on the CPU path (a host plan);
  // INTERNAL otherwise. All subgroups go to the updater as one batch (one
  // parallel pass), or subgroup by subgroup in cpu_only's order when the plan
  // waits for each one's gradients (plan.wait_ready) or while a checkpoint
  // snapshot is in flight (each is copied before it is written).
  absl::Status Execute(const StepPlan& plan, ShardState& shard,
                       std::span<const TensorBinding> bindings,
                       std::span<const AdamScalars> scalars, const StepSync& sync,
                       StepMeasurements* measured) override;
  absl::Status SyncResidentToHost(ShardState&) override { return absl::OkStatus(); }
  void DropResident(ShardState&) override {}
  absl::StatusOr<uint32_t> SetResident(ShardState&, uint32_t, bool) override { return 0u; }
  absl::StatusOr<HostBuffer> AllocStaging(uint64_t bytes) override;
  absl::Status InstallDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status CaptureDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                             double* kernel_us) override;

 private:
  CpuUpdater* const cpu_;
  CpuUpdater* const delayed_cpu_;
};

}  // namespace dos::cpu
