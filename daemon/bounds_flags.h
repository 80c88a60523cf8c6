// The flags of dosd's per-user bounds (README, threat model: "No trainer can
// starve the others"): sessions, early steps and their deadline, mapped
// bytes, descriptor-socket connections, tensors and their bookkeeping, the
// checkpoint quota and the descriptor reserve. Part of the composition root:
// main.cc calls BoundsFromFlags and StoreBoundsFromFlags once from its
// ConfigFromFlags (the flags live here so that main.cc stays within the
// structure test's file size); ParseBytes is daemon/state/host_memory_budget.h's.
//
// Thread-safety: call from main's thread, after absl::ParseCommandLine.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/common/uid_ledger.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/session/session.h"
#include "daemon/session/user_folders.h"

namespace dos {

// Fills the session options' caps (max_sessions, max_sessions_per_uid,
// early_ready_timeout) and `limits` from the flags. Defaults derived here:
// mapped bytes per uid and per session "auto" = the larger of the host's
// memory and `host_memory_limit`; an early step's deadline 0 = `session_lease`
// (60 s when that is 0). INVALID_ARGUMENT naming the flag otherwise.
absl::Status BoundsFromFlags(uint64_t host_memory_limit, absl::Duration session_lease,
                             SessionOptions* session, UidLimits* limits);

// The checkpoint store's quota (--checkpoint_quota, --checkpoint_quota_prune)
// and the descriptors kept for uids holding few sessions (--fd_reserve).
// INVALID_ARGUMENT naming the flag for a size that is not one.
absl::Status StoreBoundsFromFlags(UserFoldersOptions* folders, uint32_t* fd_reserve);

}  // namespace dos
