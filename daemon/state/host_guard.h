// Host memory guards: dosd must never be the process a trainer's memory use
// takes down.
//
// LowerOomScore(): dosd asks the kernel's OOM killer to pick anything else
// first (oom_score_adj -900, as the packaged unit's OOMScoreAdjust sets it);
// lowering needs CAP_SYS_RESOURCE, so a hand-started dosd without it logs a
// warning naming the fix and goes on. (Trainers raise their own score when
// they attach, client/src/oom_score.cc, which protects dosd also then.)
//
// CheckHostCanHold(): registration refuses state the host cannot hold beside
// what is already committed: MemAvailable (/proc/meminfo), and the limit of
// dosd's memory cgroup (v2 memory.max - memory.current, v1
// memory.limit_in_bytes - memory.usage_in_bytes) where one is set, less a
// reserve: 1 GiB or 2% of the host, whichever is larger; 4 MiB or 2% of the
// cgroup's limit.
//
// Thread-safety: both are thread-safe (they read /proc and /sys only).
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dos {

inline constexpr int kDaemonOomScoreAdj = -900;

void LowerOomScore();

// OK, or RESOURCE_EXHAUSTED naming `what`, the bytes it needs, what the host
// (or cgroup) has available and the fix.
absl::Status CheckHostCanHold(uint64_t bytes, absl::string_view what);

// The host's memory (MemTotal), or nullopt where /proc/meminfo cannot be read.
std::optional<uint64_t> HostMemoryTotal();

}  // namespace dos
