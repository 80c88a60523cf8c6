// FillUidUsage: what each uid holds of dosd's bounded resources (the session
// manager's UsageByUid) and the per-uid bounds, as the GetStats reply's
// `uids` and `uid_limits`. Stateless; thread-safe.
#pragma once

#include "daemon/session/session_manager.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos {

void FillUidUsage(const SessionManager& sessions, v1::GetStatsResponse* resp);

}  // namespace dos
