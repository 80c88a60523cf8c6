// HostMemoryBudget: the daemon-wide cap on host memory held as optimizer
// state. Every ShardState reserves its bytes here before allocating, so an
// oversized registration fails with RESOURCE_EXHAUSTED (naming the numbers)
// instead of being killed by the OOM killer halfway through a step.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace dos {

class HostMemoryBudget {
 public:
  // limit_bytes == 0 means no cap.
  explicit HostMemoryBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}

  // Reserves `bytes` for `what` (used in the error message).
  absl::Status Reserve(uint64_t bytes, absl::string_view what);
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
