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
#include <span>

#include "absl/status/statusor.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/sched/policy.h"
#include "daemon/state/shard_state.h"
#include "proto/dos/v1/control_block.h"

namespace dos {

// Where one registered tensor's trainer memory is mapped in the daemon.
struct TensorBinding {
  void* param = nullptr;        // param_dtype elements, written each step
  const void* grad = nullptr;   // grad_dtype elements, read each step
};

struct StepOutcome {
  bool found_inf = false;
  int64_t step = 0;             // tensor 0's step count after the step
  double update_us = 0;         // time spent updating (scan included)
  uint64_t cpu_subgroups = 0;
  uint64_t gpu_subgroups = 0;
};

// INVALID_ARGUMENT naming the group and field when a hyperparameter is out of
// range (lr < 0, beta outside [0, 1), eps <= 0, ...).
absl::Status ValidateStepRequest(const StepRequest& request, size_t num_groups);

class StepExecutor {
 public:
  explicit StepExecutor(cpu::CpuUpdater* cpu) : cpu_(cpu) {}

  absl::StatusOr<StepOutcome> Run(ShardState& shard, std::span<const TensorBinding> bindings,
                                  const StepRequest& request, const Policy& policy);

  // Rewrites every trainer weight from the master weights (after a state
  // import or a checkpoint load), in the parameter's dtype.
  void WriteWeights(const ShardState& shard, std::span<const TensorBinding> bindings,
                    uint32_t tensor);

 private:
  cpu::CpuUpdater* cpu_;
};

}  // namespace dos
