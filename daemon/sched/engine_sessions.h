// EngineSessions: the sessions one engine serves, and what each may hold of
// its GPU. A session is bound while it takes turns on the engine (from its
// registration until its trainer dies or it moves away); each session that
// steps reports its GPU lease, from which its share of the resident tier
// comes (step_planner.h, "Resident tier"):
//   - a session with a lease asks for the lease less the staging its plans
//     need (StagingBytes), never for more than its whole state (a trainer
//     reports what it likes);
//   - one without asks for budgets.gpu_resident_bytes (--gpu_memory_budget);
//   - with budgets.gpu_resident_bytes set and the sessions together asking
//     for more, each gets a share of it in proportion to what it asks.
// A session whose trainer died (Unbind) keeps its share, and its resident
// state, until it is resumed or its lease ends (Forget), but takes no more
// turns: no step of another session waits for it, and the engine counts as
// that session's alone again.
//
// Ownership: one per engine, owned by its StepPlanner. Thread-safety:
// thread-safe (one mutex of its own).
#pragma once

#include <cstdint>
#include <map>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/sched/step_plan.h"

namespace dos {

class EngineSessions {
 public:
  // `budgets`: the engine's (its cap on resident state and its staging
  // slots); `grad_fp32`: the engine casts CPU-path gradients to fp32 on the
  // GPU (PlannerOptions::grad_fp32).
  EngineSessions(const PlanBudgets& budgets, bool grad_fp32)
      : budgets_(budgets), grad_fp32_(grad_fp32) {}
  EngineSessions(const EngineSessions&) = delete;
  EngineSessions& operator=(const EngineSessions&) = delete;

  // The session's lease at a step (`lease.reported` false: the step carried
  // none, and a lease reported before is kept).
  void SetLease(uint64_t session, const GpuLease& lease, const ShardLayout& layout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // It takes turns on the engine (its registration), lease reported or not.
  void Bind(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);
  // Its trainer died: no more turns; its share stays until Forget.
  void Unbind(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);
  // It is gone, or moved to another engine: its share goes to the others.
  void Forget(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a session other than `session` is bound.
  bool Shared(uint64_t session) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether at most one session takes turns (bound, or stepping with a
  // lease and not unbound).
  bool Alone() const ABSL_LOCKS_EXCLUDED(mu_);
  // The session's last reported lease (reported false: none).
  GpuLease LeaseOf(uint64_t session) const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of resident state `session` may hold now (0: unknown session).
  uint64_t ResidentBytes(uint64_t session) const ABSL_LOCKS_EXCLUDED(mu_);
  // GPU memory the engine's staging for plans of `layout` takes: the slots
  // (12 bytes of state per element of the largest subgroup each, and with
  // staging_io a delayed update's gradients and weights) and, with
  // grad_fp32, two fp32 gradient casts.
  uint64_t StagingBytes(const ShardLayout& layout) const;

 private:
  struct Share {
    GpuLease lease;
    uint64_t asks = 0;  // resident bytes it asks for (before the cap's share)
    bool steps = true;  // false once its trainer died (Unbind)
  };

  const PlanBudgets budgets_;
  const bool grad_fp32_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Share> shares_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> bound_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dos
