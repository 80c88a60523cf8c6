// HostMemoryBudget: the daemon-wide cap on host memory held as optimizer
// state (--host_memory_limit). Every ShardState reserves its bytes here
// before allocating, so an oversized registration fails with
// RESOURCE_EXHAUSTED (naming the numbers) instead of being killed by the OOM
// killer halfway through a step. A shard's delayed host path buffers
// (DelayedHost, daemon/sched/delayed_host.h) are charged to the budget of
// its state too: a delayed step that would pass the cap fails the same way.
//
// State still viewed: a shard whose owner was handed its state memory
// (state_dict()'s views, ShardState::ExportStateMemory) may be destroyed
// while the trainer still maps it; those pages live on, in dosd's memory
// cgroup, until the last view is gone. HoldWhileViewed keeps such a shard's
// bytes (and its uid's state-views charge) reserved until then: dosd keeps a
// writable descriptor of the memfd and asks the kernel for a write lease on
// it (F_SETLEASE), which is granted only once no other open file of it is
// left (a mapping holds its file open). Reserve (one that would not fit)
// and the session manager's reaper (once a second) give back what is no
// longer viewed; the memory itself is freed (the last descriptor closed)
// off the lock. The ledger of the charges it keeps must outlive the budget.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/uid_ledger.h"
#include "dos/wire/unique_fd.h"

namespace dos {

class HostMemoryBudget {
 public:
  // limit_bytes == 0 means no cap.
  explicit HostMemoryBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}

  // Reserves `bytes` of optimizer state for `what` (used in the error
  // message, which suggests a registration's fixes).
  absl::Status Reserve(uint64_t bytes, absl::string_view what);
  // The same for other host memory: `held_as` says what the bytes are in
  // the message ("host memory for ..."), `fix` what the caller can do.
  absl::Status Reserve(uint64_t bytes, absl::string_view what, absl::string_view held_as,
                       absl::string_view fix);
  void Release(uint64_t bytes);
  // Copies a checkpoint in progress keeps of subgroups it has not written yet
  // (SnapshotPool): reserved as above, and named in the refusals of other
  // reservations while they last (they go as the file is written).
  absl::Status ReserveStaging(uint64_t bytes);
  void ReleaseStaging(uint64_t bytes);
  // `bytes` of a destroyed shard whose state memory may still be mapped by
  // its owner: `file` is a writable descriptor of the state's memfd opened
  // for this (HostArena::TakeLeaseFd; invalid: never exported), the only
  // one dosd keeps; `charge` the uid's state-views charge, `state_charge`
  // its charge for the bytes (kStateBytes; may be empty). Released at once
  // if nothing views it.
  void HoldWhileViewed(UniqueFd file, uint64_t bytes, LedgerCharge charge,
                       LedgerCharge state_charge = {});
  // A destroyed session's control block that a process may still map:
  // `file` a writable descriptor of its memfd opened for this (Session::
  // ControlBlockFd; the only one dosd keeps), `charge` its uid's
  // kClosedBlocks. Kept (its memfd and the charge) until nothing maps it;
  // given back at once if nothing does. Its bytes are not the budget's.
  void HoldBlockWhileMapped(UniqueFd file, LedgerCharge charge);
  // Gives back the held shards no longer viewed and the control blocks no
  // longer mapped.
  void ReapViews();
  // Control blocks held (as of the last reap).
  uint64_t held_blocks() const;

  uint64_t used() const;
  uint64_t limit() const { return limit_; }
  // Bytes and shards held for views of destroyed shards (as of the last reap).
  struct Viewed {
    uint64_t bytes = 0;
    uint64_t shards = 0;
  };
  Viewed viewed() const;

 private:
  const uint64_t limit_;
  mutable absl::Mutex mu_;
  struct Held {
    UniqueFd file;
    uint64_t bytes = 0;
    LedgerCharge charge;
    LedgerCharge state_charge;
  };
  void ReapViewsLocked(std::vector<Held>* freed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    used_ = bytes > used_ ? 0 : used_ - bytes;
  }
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Held> held_ ABSL_GUARDED_BY(mu_);
  std::vector<Held> blocks_ ABSL_GUARDED_BY(mu_);  // control blocks (bytes 0)
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether anything but `file` (a writable descriptor, the caller's only
// one) still has the file open or mapped: true while a write lease is
// refused (EAGAIN), and on an unexpected error (asked again at the next
// reap). False where leases are off or refused (EINVAL, EACCES, EPERM):
// then the views are not waited for.
bool StillViewed(int file);

// "1.50 GiB", "512.00 MiB", "12 B": for messages.
std::string FormatBytes(uint64_t bytes);
// A size as flags write it: "64G", "512M", "16k", "4096" (K, M, G, T: powers
// of 1024, either case). False for anything else, and on overflow.
bool ParseBytes(absl::string_view text, uint64_t* out);

}  // namespace dos
