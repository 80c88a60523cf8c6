// Finding the session a call names (DosService's handlers).
//
// Thread-safety: as SessionManager's.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "daemon/session/session_manager.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos {

// By id and token; INVALID_ARGUMENT for id 0.
absl::StatusOr<std::shared_ptr<Session>> FindSession(const SessionManager& sessions,
                                                     const v1::SessionRef& ref);

// Operator calls (dosctl) may name a session by id alone; clients send their
// token, which is then checked.
absl::StatusOr<std::shared_ptr<Session>> FindSessionOrOperator(const SessionManager& sessions,
                                                               const v1::SessionRef& ref);

// A live session, or one whose trainer died and that waits for a resume.
absl::StatusOr<std::shared_ptr<Session>> FindLiveOrOrphan(const SessionManager& sessions,
                                                          uint64_t id);

// A registration refused for memory (RESOURCE_EXHAUSTED), with what
// orphaned sessions hold: those of `uid` named (id, pid, bytes, the lease
// left) with how to get the memory back, other users' as a total. Any
// other status, or none orphaned, as it is.
absl::Status WithOrphansHolding(const SessionManager& sessions, uint32_t uid, absl::Status refused);

}  // namespace dos
