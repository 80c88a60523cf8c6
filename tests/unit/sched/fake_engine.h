// FakeEngine: an Engine for tests, without a GPU. It executes every plan on
// the CPU updater whatever the placement (so results are the host engine's,
// bit for bit), records each plan and reports the path the plan chose for
// each subgroup ('r', 'g', 'c') with synthetic timings from configured rates
// (so the planner's learning can be tested). "Device" memory is host memory
// the test lends it under a CUDA IPC handle string (LendDeviceMemory), so a
// session can register GPU-mode tensors and run its full step flow on it.
//
// Resident subgroups are kept as the GPU engine keeps them: in "device"
// copies of their state (heap memory attached to the shard) that only the
// fake's kernel updates, copied back by SetResident's shrink and by
// SyncResidentToHost. While a subgroup is resident its host state is
// poisoned (NaN), so a reader that forgot to bring it home sees it.
// `device_bytes` bounds the copies (growth stops there, as when a GPU is full).
//
// Readiness: a plan with wait_ready is executed as engine.h's StepSync
// contract says (wait_ready before each subgroup's gradients are read, in
// the plan's order; the first failed wait ends the step); other plans never
// call it.
//
// Faults are injected at the engine and transport seams: Execute failing
// after N subgroups (an engine error mid-step), AllFinite, AttachShard,
// OpenTrainerEvent failing, and transports that fail to map.
//
// Thread-safety: thread-safe (one mutex around its records and faults).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/sched/engine.h"

namespace dos {

struct FakeEngineOptions {
  bool gpu = false;                    // plans may use a GPU
  double cpu_params_per_s = 1e9;       // synthetic rates the measurements report
  double gpu_params_per_s = 100e9;
  double copy_bytes_per_s = 50e9;
  uint64_t device_bytes = 0;           // resident copies held at most; 0: no limit
  // A delayed step starts the update before its copies, as GpuEngine's
  // CaptureLoop does (DelayedHost::await_capture), then copies subgroup by
  // subgroup a millisecond apart: an update that did not wait for each
  // subgroup's copies would run ahead of them.
  bool pipelined_captures = false;
  // The delayed update takes this long a subgroup more (a slow host: the
  // next step begins beside it, a hand-off).
  int slow_update_ms = 0;
};

class FakeEngine final : public Engine {
 public:
  using Options = FakeEngineOptions;
  explicit FakeEngine(Options options = {});

  // Memory a CUDA IPC location with handle `handle` resolves to.
  void LendDeviceMemory(const std::string& handle, void* base, uint64_t bytes);

  // Faults (a default Status clears one).
  void FailExecuteAfter(uint32_t subgroups, absl::Status status);
  void FailAllFinite(absl::Status status);
  void FailAttach(absl::Status status);
  void FailMap(absl::Status status);
  void FailOpenEvent(absl::Status status);

  // Records.
  std::vector<StepPlan> plans() const;
  int attached() const;
  int open_events() const;  // opened and not closed
  // SyncTrainerEvent ('e'), WaitTrainerEvent ('w') and AllFinite ('s') calls,
  // in their order.
  std::string waits() const;
  std::vector<uint32_t> done_subgroups() const;  // subgroup_done calls of the last step
  // With pipelined_captures: the subgroups the delayed update waited for, in order.
  std::vector<uint32_t> awaited_captures() const;

  bool has_gpu() const override { return options_.gpu; }
  bool host_addressable() const override { return true; }
  std::string name() const override { return options_.gpu ? "fake-gpu" : "fake-host"; }
  std::unique_ptr<Transport> NewTransport() override;
  absl::Status AttachShard(ShardState& shard, RegisterProgress* progress) override;
  absl::StatusOr<void*> OpenTrainerEvent(const std::string& handle) override;
  void CloseTrainerEvent(void* event) override;
  absl::Status WaitTrainerEvent(void* event) override;
  absl::Status SyncTrainerEvent(void* event) override;
  absl::Status CopyToHost(void* dst, const void* trainer_src, uint64_t bytes) override;
  absl::Status CopyToTrainer(void* trainer_dst, const void* src, uint64_t bytes) override;
  absl::StatusOr<bool> AllFinite(const ShardState& shard,
                                 std::span<const TensorBinding> bindings) override;
  absl::Status Execute(const StepPlan& plan, ShardState& shard,
                       std::span<const TensorBinding> bindings,
                       std::span<const cpu::AdamScalars> scalars, const StepSync& sync,
                       StepMeasurements* measured) override;
  absl::Status SyncResidentToHost(ShardState& shard) override;
  void DropResident(ShardState& shard) override;
  absl::StatusOr<uint32_t> SetResident(ShardState& shard, uint32_t count, bool grow) override;
  // The delayed host path as the host engine runs it (shared memory).
  absl::StatusOr<HostBuffer> AllocStaging(uint64_t bytes) override;
  absl::Status InstallDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status CaptureDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                             double* kernel_us) override;
  // Resident copies held now, all shards (bytes).
  uint64_t resident_bytes() const;

  // Resolves a lent CUDA IPC location (FakeTransport).
  absl::StatusOr<void*> Resolve(const MemoryRef& ref, uint64_t bytes, absl::string_view what);
  absl::Status map_fault() const;

 private:
  // The order the plan's subgroups are updated in, with each one's path.
  static std::vector<std::pair<uint32_t, char>> Order(const StepPlan& plan);
  // A delayed step's copies with pipelined_captures (above).
  absl::Status PipelinedCaptures(const StepPlan& plan, const ShardState& shard,
                                 std::span<const TensorBinding> bindings, const StepSync& sync);
  void Measure(uint32_t sg, char path, uint64_t numel, StepMeasurements* m) const;

  class Resident;  // a shard's copies (its attachment)
  Resident* ResidentOf(ShardState& shard);

  const Options options_;
  cpu::CpuUpdater cpu_;
  std::atomic<uint64_t> resident_bytes_{0};
  mutable absl::Mutex mu_;
  std::map<std::string, std::pair<char*, uint64_t>> device_memory_ ABSL_GUARDED_BY(mu_);
  std::optional<uint32_t> fail_execute_after_ ABSL_GUARDED_BY(mu_);
  absl::Status execute_fault_ ABSL_GUARDED_BY(mu_);
  absl::Status all_finite_fault_ ABSL_GUARDED_BY(mu_);
  absl::Status attach_fault_ ABSL_GUARDED_BY(mu_);
  absl::Status map_fault_ ABSL_GUARDED_BY(mu_);
  absl::Status event_fault_ ABSL_GUARDED_BY(mu_);
  std::vector<StepPlan> plans_ ABSL_GUARDED_BY(mu_);
  int attached_ ABSL_GUARDED_BY(mu_) = 0;
  int open_events_ ABSL_GUARDED_BY(mu_) = 0;
  std::string waits_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> done_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> awaited_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dos
