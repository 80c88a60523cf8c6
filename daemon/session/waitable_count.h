// WaitableCount: how many waits of one kind are in progress (a session's
// waits for its trainer), and a wait, with a deadline, for none to be.
//
// The checkpointer waits on it instead of polling: the Mutex re-evaluates the
// waiter's condition whenever Remove() releases it, so the waiter wakes as
// soon as the count reaches zero (not up to a poll interval later) and costs
// nothing while it waits.
//
// Thread-safety: every method is thread-safe. Add() and Remove() take the
// mutex once each (twice per early step: not per tile or subgroup).
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dos {

class WaitableCount {
 public:
  void Add() {
    absl::MutexLock lock(&mu_);
    ++n_;
  }
  // Wakes the waiters whose condition now holds (absl::Mutex re-evaluates
  // them on release).
  void Remove() {
    absl::MutexLock lock(&mu_);
    --n_;
  }
  bool nonzero() const {
    absl::MutexLock lock(&mu_);
    return n_ > 0;
  }
  // True once the count is zero, false if it still is not at `deadline`
  // (a deadline already past: whether it is zero now).
  bool WaitForZero(absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    auto zero = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return n_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&zero), deadline);
  }

 private:
  mutable absl::Mutex mu_;
  int n_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dos
