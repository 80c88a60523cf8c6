#include "daemon/rpc/session_lookup.h"

namespace dos {

absl::StatusOr<std::shared_ptr<Session>> FindSession(const SessionManager& sessions,
                                                     const v1::SessionRef& ref) {
  if (ref.session_id() == 0) {
    return absl::InvalidArgumentError("session.session_id is 0; pass the id Attach returned");
  }
  return sessions.Find(ref.session_id(), ref.token());
}

absl::StatusOr<std::shared_ptr<Session>> FindSessionOrOperator(const SessionManager& sessions,
                                                               const v1::SessionRef& ref) {
  if (ref.token().empty()) return sessions.FindUnchecked(ref.session_id());
  return FindSession(sessions, ref);
}

absl::StatusOr<std::shared_ptr<Session>> FindLiveOrOrphan(const SessionManager& sessions,
                                                          uint64_t id) {
  absl::StatusOr<std::shared_ptr<Session>> s = sessions.FindUnchecked(id);
  if (s.ok()) return s;
  for (auto& o : sessions.ListOrphans()) {
    if (o->identity().id == id) return o;
  }
  return s.status();
}

}  // namespace dos
