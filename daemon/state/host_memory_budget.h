// HostMemoryBudget: the daemon-wide cap on host memory held as optimizer
// state (--host_memory_limit). Every ShardState reserves its bytes here
// before allocating, so an oversized registration fails with
// RESOURCE_EXHAUSTED (naming the numbers) instead of being killed by the OOM
// killer halfway through a step. A shard's delayed host path buffers
// (DelayedHost, daemon/sched/delayed_host.h) are charged to the budget of
// its state too: a delayed step that would pass the cap fails the same way.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

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

  uint64_t used() const;
  uint64_t limit() const { return limit_; }

 private:
  const uint64_t limit_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

// "1.50 GiB", "512.00 MiB", "12 B": for messages.
std::string FormatBytes(uint64_t bytes);
// A size as flags write it: "64G", "512M", "16k", "4096" (K, M, G, T: powers
// of 1024, either case). False for anything else, and on overflow.
bool ParseBytes(absl::string_view text, uint64_t* out);

}  // namespace dos
