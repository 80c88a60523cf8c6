// The RPC side of the per-uid bounds. FillUidUsage: what each uid holds of
// dosd's bounded resources (the session manager's UsageByUid) and the
// per-uid bounds, as the GetStats reply's `uids` and `uid_limits`.
// AdmitRegistration: the bookkeeping check of a RegisterShard request.
// Stateless; thread-safe.
#pragma once

#include "daemon/session/session_manager.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos {

void FillUidUsage(const SessionManager& sessions, v1::GetStatsResponse* resp);

// Refuses a RegisterShard request whose tensors' bookkeeping cannot be
// charged (a name past kMaxTensorNameBytes; past the uid's tensors or
// bookkeeping bound) from the request itself, before
// it is copied into a ShardSpec: a hopeless request of 100,000 tensors or
// megabyte names then costs dosd no copies. Session::Register charges.
absl::Status AdmitRegistration(const Session& session, const v1::RegisterShardRequest& req);

}  // namespace dos
