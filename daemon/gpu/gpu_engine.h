// GpuEngine: the Engine of one CUDA device (DESIGN.md section 3). It executes
// the planner's plans; it decides no placement itself.
//
// Per step, subgroups go the way the plan says:
//  - resident: state kept in GPU memory between steps: the fused kernel alone
//    (gpu_shard.cc keeps the plan's resident count allocated).
//  - streamed (GPU path, gpu_stream_path.cc): H2D the subgroup's fp32
//    [p|m|v] into a staging slot, the fused kernel (gradients read and
//    weights written in place through CUDA IPC), D2H [p|m|v] back. Three
//    streams and `staging_slots` slots make a pipeline: H2D(i+1) ||
//    kernel(i) || D2H(i-1).
//  - CPU path (gpu_cpu_path.cc): D2H the gradients (16-bit as they are, or
//    cast to fp32 on the GPU first with cpu_grad_fp32) into pinned buffers,
//    the CPU kernel over the pinned host state, 16-bit weights H2D into the
//    trainer's buffer; four buffers deep so the next subgroup's gradients
//    arrive while the CPU works.
// The GPU path runs on the engine's long-lived worker thread (`dos-gpu-N`)
// while the step's thread runs the CPU path; both claim from the plan's
// SubgroupQueue, the GPU side asking the plan's TakeShared rule. Timings are
// measured (CUDA events and host clocks) into StepMeasurements.
//
// Before the verdict (Prefetch, while backward still runs on the trainer's
// side) the first streamed subgroups' state is copied into the staging
// slots: the GPU-path streams that move only state (H2D, D2H) do not wait
// for the trainer's event, the compute stream and the CPU path's gradient
// copies do.
//
// Host state is page-locked in place (cudaHostRegister of each subgroup's
// allocation) at AttachShard; resident and staging memory is plain
// cudaMalloc.
//
// Ownership: the engine owns its streams, events, staging and pinned
// buffers and its worker; per-shard registrations and resident copies are
// attached to the ShardState and freed with it. It must outlive every session.
// Thread-safety: thread-safe; Execute calls are serialised on `step_mu_`.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/gpu/gpu_worker.h"
#include "daemon/sched/engine.h"

namespace dos::gpu {

struct GpuEngineOptions {
  int device = 0;                  // CUDA device ordinal
  int staging_slots = 2;           // streamed subgroups in flight
  bool prefetch = true;            // Prefetch copies state before the verdict (dosd: --gpu_prefetch)
  bool cpu_grad_fp32 = false;      // CPU path: cast gradients to fp32 on the GPU before D2H
  // CPU path: gradients and weights crossed by a kernel (pcie_copy.h) on
  // streams of their own, or (false) by the copy engines, the weights queued
  // behind the GPU path's state copies (dosd: --gpu_cpu_path_copy).
  bool cpu_copy_kernel = true;
  // Page-locking a shard's state at registration: one cudaHostRegister per
  // subgroup from `pin_threads` threads (0: one per core, at most 16), or
  // (`pin_whole`) one for the shard's whole mapping; equally fast when
  // measured (bench/register; dosd has no flags for them since), but per
  // subgroup reports progress as it goes.
  bool pin_whole = false;
  int pin_threads = 0;
  // The delayed update's kernels on the GPU (UpdateDelayedOnGpu) read the
  // gradients and write the weights in page-locked host memory: at most this
  // many blocks each (DeviceAdamSpan::max_blocks; 0: every SM).
  uint32_t delayed_kernel_blocks = 0;
  // The delayed update's gradients copied into the staging slot and its
  // weights out by the copy engines, beside the state, so that its kernels
  // touch GPU memory only (dosd: --delayed_gpu_staged): each slot then
  // holds kStagedIoBytesPerParam more per element (PlanBudgets::staging_io).
  bool delayed_staged = false;
};

// Where a slot's staged gradients and weights start (GpuEngine::SlotBytes).
inline constexpr uint64_t kStagedIoAlign = 256;

class GpuEngine final : public Engine {
 public:
  // UNAVAILABLE when there is no such device (the daemon then runs CPU only).
  // `delayed_cpu`: the delayed update's updater (null: `cpu`).
  static absl::StatusOr<std::unique_ptr<GpuEngine>> Create(const GpuEngineOptions& options,
                                                           cpu::CpuUpdater* cpu,
                                                           cpu::CpuUpdater* delayed_cpu = nullptr);
  ~GpuEngine() override;
  // CUDA devices this process sees (0 without a driver or device).
  static int VisibleDevices();

  const std::string& device_uuid() const { return uuid_; }
  const std::string& device_name() const { return name_; }
  int device() const { return options_.device; }

  bool has_gpu() const override { return true; }
  bool host_addressable() const override { return false; }
  std::string name() const override;
  std::unique_ptr<Transport> NewTransport() override;
  absl::Status CopyToHost(void* dst, const void* device_src, uint64_t bytes) override;
  absl::Status CopyToTrainer(void* device_dst, const void* src, uint64_t bytes) override;
  absl::Status AttachShard(ShardState& shard, RegisterProgress* progress) override;
  absl::StatusOr<bool> AllFinite(const ShardState& shard,
                                 std::span<const TensorBinding> bindings) override;
  absl::StatusOr<void*> OpenTrainerEvent(const std::string& handle) override;
  void CloseTrainerEvent(void* event) override;
  absl::Status WaitTrainerEvent(void* event) override;
  absl::Status SyncTrainerEvent(void* event) override;
  absl::Status Prefetch(const StepPlan& plan, ShardState& shard) override;
  absl::Status Execute(const StepPlan& plan, ShardState& shard,
                       std::span<const TensorBinding> bindings,
                       std::span<const cpu::AdamScalars> scalars, const StepSync& sync,
                       StepMeasurements* measured) override;
  absl::Status SyncResidentToHost(ShardState& shard) override;
  void DropResident(ShardState& shard) override;
  absl::StatusOr<uint32_t> SetResident(ShardState& shard, uint32_t count, bool grow) override;
  // The delayed host path (gpu_delayed.cc).
  absl::StatusOr<HostBuffer> AllocStaging(uint64_t bytes) override;
  absl::Status InstallDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status CaptureDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                              const DelayedHost& delayed,
                              std::span<const uint32_t> subgroups) override;
  absl::Status UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                             double* kernel_us) override;

  // A staging slot's content copied by Prefetch: subgroup `subgroup` of
  // `shard` at step count `step` (tensor 0's), queued on the H2D stream.
  struct SlotPrefetch {
    const ShardState* shard = nullptr;  // null: nothing prefetched
    uint32_t subgroup = 0;
    int64_t step = 0;
  };
  class Shard;     // per-shard attachment (gpu_engine.cc)
  struct StepRun;  // one step's working state (gpu_engine.cc)

 private:
  GpuEngine(const GpuEngineOptions& options, cpu::CpuUpdater* cpu, cpu::CpuUpdater* delayed_cpu);
  absl::Status Init();
  absl::Status EnsureBuffers(uint64_t max_numel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // SetResident's work, on the current device.
  absl::StatusOr<uint32_t> ResizeResident(ShardState& shard, uint32_t count, bool grow)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // The step's two sides (gpu_stream_path.cc, gpu_cpu_path.cc), run at once.
  absl::Status GpuLoop(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  absl::Status StreamSubgroups(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  absl::Status CpuLoop(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // InstallDelayed (`capture` false: the pending weights of `subgroups`)
  // and CaptureDelayed (true: those delayed.installs() names, then every
  // one's gradients), on the CPU path's streams; returns once they are in.
  absl::Status CopyDelayed(const ShardState& shard, std::span<const TensorBinding> bindings,
                           const DelayedHost& delayed, std::span<const uint32_t> subgroups,
                           bool capture) ABSL_LOCKS_EXCLUDED(step_mu_);
  // A delayed step's CPU side: the delayed subgroups' pending weights H2D
  // and their gradients D2H, each marked done after both (gpu_delayed.cc).
  absl::Status CaptureLoop(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // The delayed update's subgroups that DelayedHost::updates_on_gpu names,
  // streamed through the staging slots (their gradients read from, and new
  // weights written to, the page-locked delayed buffers), beside the CPU
  // kernel's (gpu_delayed.cc; StreamDelayed in gpu_stream_path.cc).
  absl::Status UpdateDelayedOnGpu(ShardState& shard, const DelayedHost& delayed)
      ABSL_LOCKS_EXCLUDED(step_mu_);
  absl::Status StreamDelayed(StepRun& run, std::span<const uint32_t> subgroups)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // The window (StepMeasurements::window_us) from the shard's events.
  void MeasureWindow(StepRun& run, StepMeasurements* m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // Fills `measured` from a finished run.
  void Measure(StepRun& run, double wall_us, StepMeasurements* measured)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);

  const GpuEngineOptions options_;
  cpu::CpuUpdater* const cpu_;
  cpu::CpuUpdater* const delayed_cpu_;  // the delayed update's (fewer threads)
  std::string uuid_;
  std::string name_;

  mutable absl::Mutex step_mu_;
  cudaStream_t h2d_ = nullptr, compute_ = nullptr, d2h_ = nullptr;   // GPU path (streamed)
  cudaStream_t resident_ = nullptr;                                  // resident subgroups' kernels
  cudaStream_t cpu_d2h_ = nullptr, cpu_h2d_ = nullptr;               // CPU path
  // The delayed path's copies outside a step (CopyDelayed: an early step's
  // captures during backward, installs), on streams of their own under a
  // mutex of their own: not behind step_mu_, which the delayed update's GPU
  // share holds through the trainer's window (a hand-off's captures run
  // then).
  absl::Mutex copy_mu_ ABSL_ACQUIRED_AFTER(step_mu_);
  cudaStream_t copy_d2h_ = nullptr, copy_h2d_ = nullptr;
  uint64_t buffer_numel_ ABSL_GUARDED_BY(step_mu_) = 0;
  // device, SlotBytes(buffer_numel) each: the state (12 bytes per element),
  // then with delayed_staged a delayed update's gradients and weights
  // (kStagedIoBytesPerParam: grad_elem then weight_elem strides of
  // buffer_numel elements each, each part on kStagedIoAlign bytes)
  std::vector<float*> slots_ ABSL_GUARDED_BY(step_mu_);
  uint64_t SlotBytes(uint64_t numel) const {
    return numel * ShardState::kStateBytesPerParam +
           (options_.delayed_staged ? numel * kStagedIoBytesPerParam + 2 * kStagedIoAlign : 0);
  }
  std::vector<SlotPrefetch> prefetch_ ABSL_GUARDED_BY(step_mu_);  // per slot
  std::vector<char*> grad_host_ ABSL_GUARDED_BY(step_mu_);   // pinned, 4 * buffer_numel (x2)
  std::vector<char*> weight_host_ ABSL_GUARDED_BY(step_mu_); // pinned, 4 * buffer_numel (x2)
  std::vector<float*> cast_dev_ ABSL_GUARDED_BY(step_mu_);   // device, cpu_grad_fp32 only (x2)
  int* flag_dev_ = nullptr;   // non-finite flag
  // Resident state on this engine's device, all shards (shards hold a
  // pointer: they may outlive a step, never the engine).
  std::atomic<uint64_t> resident_bytes_{0};
  int* flag_host_ = nullptr;  // pinned
  // Runs the GPU path of each step beside the step's thread (started once).
  std::unique_ptr<GpuWorker> worker_;
};

}  // namespace dos::gpu
