// Session: one attached trainer process (one rank) and everything the daemon
// holds for it: its identity and token, its control block in shared memory,
// the mappings of its tensor memory, its fp32 optimizer state (ShardState),
// its scheduling policy, its statistics, and the step thread that answers its
// doorbell.
//
// Lifecycle: Create (at Attach) -> Register (once) -> steps over the control
// block -> Stop (detach, client death, daemon shutdown). Stop lets an
// in-flight step finish, marks the control block closed (a waiting client gets
// UNAVAILABLE) and joins the step thread.
//
// Thread-safety: all public methods are thread-safe. `mu_` serialises steps
// with registration and state transfer; statistics sit behind `stats_mu_` so
// dosctl never waits for a step.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/sched/policy.h"
#include "daemon/sched/step_executor.h"
#include "daemon/state/shard_state.h"
#include "daemon/transport/control_channel.h"
#include "daemon/transport/shm_segment.h"
#include "daemon/transport/transport.h"

namespace dos {

struct SessionIdentity {
  uint64_t id = 0;
  std::string token;
  std::string client_name;
  int32_t pid = 0;
  int32_t rank = -1;
  int32_t local_rank = 0;
  int32_t world_size = 1;
};

// One tensor as the client describes it at registration.
struct TensorSpec {
  std::string name;
  DType param_dtype = DType::kF32;
  DType grad_dtype = DType::kF32;
  uint64_t numel = 0;
  uint32_t group = 0;
  MemoryRef param;
  MemoryRef grad;
};

struct ShardSpec {
  std::vector<TensorSpec> tensors;
  std::vector<GroupConfig> groups;
  uint64_t subgroup_size = 0;  // 0: the daemon's default
};

struct SessionOptions {
  std::string shm_prefix = "/dos";   // control block name: <prefix>.<daemon pid>.<id>.ctl
  mode_t shm_mode = 0660;
  uint64_t default_subgroup_size = 100'000'000;
  absl::Duration liveness_interval = absl::Milliseconds(200);
};

struct SessionStatsSnapshot {
  uint64_t steps = 0;
  uint64_t skipped_steps = 0;
  uint64_t failed_steps = 0;
  StepOutcome last;
  double last_wall_us = 0;
};

class Session {
 public:
  // Creates the control block and starts the step thread. `on_client_gone`
  // is called (from the step thread) once the client's process has exited.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      SessionIdentity identity, const SessionOptions& options, const Policy& policy,
      StepExecutor* executor, HostMemoryBudget* budget,
      std::function<void(uint64_t id)> on_client_gone);
  ~Session();  // Stop()s.

  // Maps the tensors, validates them and initialises the state from the
  // trainer's weights. FAILED_PRECONDITION if already registered.
  absl::Status Register(const ShardSpec& spec);

  // State transfer (fp32 master, exp_avg, exp_avg_sq back to back at `buf`).
  absl::StatusOr<int64_t> ExportState(uint32_t tensor, const MemoryRef& buf);
  absl::Status ImportState(uint32_t tensor, const MemoryRef& buf, int64_t step);

  void SetPolicy(const Policy& policy);
  Policy policy() const;

  // Finishes any in-flight step, closes the control block, joins the thread.
  void Stop();

  const SessionIdentity& identity() const { return identity_; }
  bool TokenMatches(absl::string_view token) const;
  const std::string& control_block_name() const { return control_->name(); }
  uint64_t control_block_bytes() const { return control_->size(); }

  struct Summary {
    bool registered = false;
    uint64_t params = 0;
    uint32_t tensors = 0;
    uint32_t subgroups = 0;
    uint64_t state_bytes = 0;
  };
  Summary summary() const;
  SessionStatsSnapshot stats() const;

 private:
  Session(SessionIdentity identity, const SessionOptions& options, const Policy& policy,
          StepExecutor* executor, HostMemoryBudget* budget,
          std::function<void(uint64_t)> on_client_gone);
  void StepLoop();
  void HandleRequest(uint32_t seq);
  bool ClientAlive() const;
  absl::StatusOr<float*> MapStateBuffer(uint32_t tensor, const MemoryRef& buf,
                                        std::unique_ptr<ShmSegment>* holder)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionIdentity identity_;
  const SessionOptions options_;
  StepExecutor* const executor_;
  HostMemoryBudget* const budget_;
  const std::function<void(uint64_t)> on_client_gone_;

  std::unique_ptr<ShmSegment> control_;
  std::unique_ptr<ControlBlockChannel> channel_;

  mutable absl::Mutex mu_;
  std::unique_ptr<Transport> transport_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ShardState> shard_ ABSL_GUARDED_BY(mu_);
  std::vector<TensorBinding> bindings_ ABSL_GUARDED_BY(mu_);
  

  mutable absl::Mutex stats_mu_;
  SessionStatsSnapshot stats_ ABSL_GUARDED_BY(stats_mu_);
  Policy policy_ ABSL_GUARDED_BY(stats_mu_);
  Summary summary_ ABSL_GUARDED_BY(stats_mu_);

  std::atomic<bool> stop_{false};
  std::thread step_thread_;
};

}  // namespace dos
