// TrainerGate: a session's early steps that hold it waiting for their
// trainer, and the order in which they and a snapshot reach Session::mu_.
//
// An early step holds mu_ while it waits for its trainer's gradients and
// verdict (up to --early_step_ready_timeout). An autosave must not queue for
// mu_ behind such a step, or every other session's autosave waits too; but
// "is a step waiting?" checked before locking races with a step that starts
// right after the check and locks first. The gate closes that window: a
// snapshot queues through it (QueueSnapshot) before it locks mu_, an early
// step counts itself through it (BeginEarlyStep) before it locks mu_, and
// the two exclude each other there. Either the step counted first (the
// snapshot sees it and gives up), or the snapshot queued first (the step
// waits at the gate until the snapshot holds mu_: under it a snapshot only
// marks a step boundary, so the step waits briefly).
//
// The checkpointer waits for the count to reach zero instead of polling: the
// Mutex re-evaluates the waiter's condition whenever EndEarlyStep() releases
// it, so the waiter wakes at once and costs nothing while it waits.
//
// Thread-safety: every method is thread-safe; each takes the gate's mutex
// once (twice per early step and per snapshot lock, not per subgroup).
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dos {

class TrainerGate {
 public:
  // Step side, before it locks mu_: waits until no snapshot is queued, then
  // counts the early step.
  void BeginEarlyStep() {
    absl::MutexLock lock(&mu_);
    auto none_queued = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return queued_ == 0; };
    mu_.Await(absl::Condition(&none_queued));
    ++steps_;
  }
  // The same without waiting (a hand-off, under mu_ already): false, and
  // nothing counted, when a snapshot is queued.
  bool TryBeginEarlyStep() {
    absl::MutexLock lock(&mu_);
    if (queued_ > 0) return false;
    ++steps_;
    return true;
  }
  // Wakes the waiters whose condition now holds (absl::Mutex re-evaluates
  // them on release).
  void EndEarlyStep() {
    absl::MutexLock lock(&mu_);
    --steps_;
  }
  // Snapshot side, before it locks mu_: false (nothing queued) when an
  // early step is counted; otherwise queues the snapshot, which calls
  // SnapshotLocked() once it holds mu_.
  bool QueueSnapshot() {
    absl::MutexLock lock(&mu_);
    if (steps_ > 0) return false;
    ++queued_;
    return true;
  }
  void SnapshotLocked() {
    absl::MutexLock lock(&mu_);
    --queued_;
  }

  bool waiting() const {
    absl::MutexLock lock(&mu_);
    return steps_ > 0;
  }
  // True once no early step is counted, false if one still is at `deadline`
  // (a deadline already past: whether none is now).
  bool WaitUntilNone(absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    auto none = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return steps_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
  }

 private:
  mutable absl::Mutex mu_;
  int steps_ ABSL_GUARDED_BY(mu_) = 0;   // early steps holding (or about to hold) mu_
  int queued_ ABSL_GUARDED_BY(mu_) = 0;  // snapshots queued for mu_
};

}  // namespace dos
