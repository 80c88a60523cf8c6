// StepExecutor: runs one optimizer step of one shard.
//
// It validates the step's hyperparameters, scans the gradients for
// non-finite values (unless the client already did), and then updates every
// subgroup: today all of them on the CPU updater; the GPU engine and the
// performance model plug in here (the policy is passed through for that).
// A step with non-finite gradients applies nothing and leaves every step
// counter unchanged, as AMP's GradScaler skips optimizer.step().
//
// Thread-safety: Run may be called concurrently for different shards; the
// caller serialises calls for one shard. The executor owns nothing but
// pointers to engines that outlive it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/sched/gpu_backend.h"
#include "daemon/sched/policy.h"
#include "daemon/state/shard_state.h"
#include "dos/wire/control_block.h"

namespace dos {

// Where one registered tensor's trainer memory is mapped in the daemon.
struct TensorBinding {
  void* param = nullptr;        // param_dtype elements, written each step
  const void* grad = nullptr;   // grad_dtype elements, read each step
  bool device = false;          // both live in GPU memory (CUDA IPC): GPU mode
};

// How one step synchronises with the trainer beyond the doorbells.
struct StepSync {
  // GPU mode: the trainer's IPC event (opened by GpuBackend::OpenTrainerEvent)
  // recorded after its gradients were final; every daemon stream that reads
  // gradients waits on it. Null: the trainer synchronised before ringing.
  void* trainer_event = nullptr;
  // Called once per subgroup as soon as its new weights are in the trainer's
  // memory, from any thread (CUDA host callbacks included): it must be cheap
  // and must not call CUDA. May be empty.
  std::function<void(uint32_t subgroup)> subgroup_done;
};

struct StepOutcome {
  bool found_inf = false;
  int64_t step = 0;             // tensor 0's step count after the step
  double update_us = 0;         // time spent updating (scan included)
  uint64_t cpu_subgroups = 0;
  uint64_t gpu_subgroups = 0;      // streamed through staging slots
  uint64_t resident_subgroups = 0; // updated in place in GPU memory
  // GPU mode only (zero on the CPU path):
  uint64_t cpu_params = 0;
  uint64_t gpu_params = 0;         // streamed and resident
  uint64_t h2d_bytes = 0;          // state, weights
  uint64_t d2h_bytes = 0;          // state, gradients
  double cpu_busy_us = 0;          // CPU kernel time
  double gpu_busy_us = 0;          // GPU kernel time
  double h2d_busy_us = 0;          // copy-engine time per direction
  double d2h_busy_us = 0;
  double predicted_us = 0;         // the performance model's forecast
  double model_gpu_share = 0;      // x the model chose (auto) or the policy implies
  std::string model_binding;       // the constraint the model says limits the step
  uint64_t gpu_memory_bytes = 0;   // staging slots + resident state on the GPU
};

// INVALID_ARGUMENT naming the group and field when a hyperparameter is out of
// range (lr < 0, beta outside [0, 1), eps <= 0, ...).
absl::Status ValidateStepRequest(const StepRequest& request, size_t num_groups);

class StepExecutor {
 public:
  // `gpu` may be null (no CUDA build or no GPU): device bindings are then
  // refused at registration, and every step runs on the CPU.
  explicit StepExecutor(cpu::CpuUpdater* cpu, GpuBackend* gpu = nullptr) : cpu_(cpu), gpu_(gpu) {}

  GpuBackend* gpu() const { return gpu_; }

  absl::StatusOr<StepOutcome> Run(ShardState& shard, std::span<const TensorBinding> bindings,
                                  const StepRequest& request, const Policy& policy,
                                  const StepSync& sync = {});

  // Rewrites every trainer weight from the master weights (after a state
  // import or a checkpoint load), in the parameter's dtype.
  absl::Status WriteWeights(const ShardState& shard, std::span<const TensorBinding> bindings,
                            uint32_t tensor);
  // The same for elements [offset, offset + count) of the tensor (a ranged
  // state import); the caller checks that the range lies inside it.
  absl::Status WriteWeightsRange(const ShardState& shard, std::span<const TensorBinding> bindings,
                                 uint32_t tensor, uint64_t offset, uint64_t count);
  // Initialises tensor `tensor`'s fp32 master weights from the trainer's
  // weights (host or device memory). Uses the tensor's exp_avg as staging
  // for device weights (zero before and after): call at registration only.
  // Fastest when the shard is already page-locked (GpuBackend::AttachShard).
  absl::Status ReadWeights(ShardState& shard, std::span<const TensorBinding> bindings,
                           uint32_t tensor);

 private:
  cpu::CpuUpdater* cpu_;
  GpuBackend* gpu_;
};

}  // namespace dos
