// The trainer's side of "dosd is never the OOM killer's victim". dosd holds
// every session's state: the packaged unit gives it OOMScoreAdjust=-900 and a
// hand-started dosd lowers its own score where it may
// (daemon/state/host_guard.h). Where it could not (no CAP_SYS_RESOURCE: its
// oom_score_adj, read from /proc, is above -500, or cannot be read), each
// trainer raises its own score at attach to 1000 (any process may raise its
// own), so that the kernel kills a trainer that exhausts memory, never dosd
// and with it every session. DOS_TRAINER_OOM_SCORE_ADJ sets the value
// (-1000..1000) or "keep" leaves the score alone. Never fails: a score it
// cannot write is left as it is.
//
// Thread-safety: thread-safe.
#pragma once

#include <sys/types.h>

namespace dos::client {

inline constexpr int kTrainerOomScoreAdj = 1000;

void RaiseOomScore(pid_t daemon_pid);

}  // namespace dos::client
