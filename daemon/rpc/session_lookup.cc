#include "daemon/rpc/session_lookup.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/state/host_memory_budget.h"

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

absl::Status WithOrphansHolding(const SessionManager& sessions, uint32_t uid,
                                absl::Status refused) {
  if (refused.code() != absl::StatusCode::kResourceExhausted) return refused;
  std::string own;
  uint64_t others_bytes = 0;
  size_t others = 0;
  for (const auto& o : sessions.ListOrphans()) {
    const uint64_t bytes = o->summary().state_bytes;
    const SessionIdentity& id = o->identity();
    if (id.uid != uid) {
      others_bytes += bytes;
      ++others;
      continue;
    }
    const absl::Duration left = absl::Ceil(sessions.OrphanLeaseLeft(id.id), absl::Seconds(1));
    absl::StrAppend(&own, own.empty() ? "" : ", ", "session ", id.id, " (pid ", id.pid, ", ",
                    FormatBytes(bytes), ", lease ends in ", absl::FormatDuration(left), ")");
  }
  if (own.empty() && others == 0) return refused;
  std::string msg(refused.message());
  if (!own.empty()) {
    absl::StrAppend(&msg, "; trainers of yours that exited without detaching hold ", own,
                    ", kept for a resume: resume one (dos.torch.AdamW(..., resume=its "
                    "opt.session_info())), or register again once its lease ends");
  }
  if (others > 0) {
    absl::StrAppend(&msg, "; ", others, " exited trainer(s) of other users hold ",
                    FormatBytes(others_bytes), " until their leases end (dosd --session_lease)");
  }
  return absl::Status(refused.code(), msg);
}

}  // namespace dos
