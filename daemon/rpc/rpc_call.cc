#include "daemon/rpc/rpc_call.h"

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"

namespace dos {

absl::Status RpcCall::Admit(CallRights rights, absl::string_view what) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  switch (rights) {
    case CallRights::kAnyone:
      return absl::OkStatus();
    case CallRights::kLocal:
      return authorizer_->MustBeLocal(caller_, what);
    case CallRights::kMember:
      // The socket's file mode keeps outsiders off the unix socket; a TCP
      // port does not, so job names and pids go only to operators there.
      if (caller_.known || authorizer_->IsOperator(caller_)) return absl::OkStatus();
      return absl::PermissionDeniedError(
          "sessions: callers over the TCP listener carry no identity, and the session list (job "
          "names, pids) is for the trainers' group; use dosd's unix socket as a member of its "
          "group, or start dosd with --tcp_operator_calls (TCP callers are then operators)");
  }
  return absl::InternalError(absl::StrCat(what, ": unknown CallRights"));
}

absl::Status RpcCall::Logged(absl::Status st, absl::string_view what) const {
  if (!st.ok()) DOS_LOG_WARNING("auth.call_refused", "call", what, "error", st.message());
  return st;
}

absl::Status RpcCall::MayActOn(const Session& s, absl::string_view what) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  return Logged(authorizer_->MayActOn(caller_, s.identity().uid, s.identity().id, what), what);
}

absl::StatusOr<std::shared_ptr<Session>> RpcCall::MayActOn(
    absl::StatusOr<std::shared_ptr<Session>> found, absl::string_view what) const {
  if (!found.ok()) return found.status();
  if (absl::Status st = MayActOn(**found, what); !st.ok()) return st;
  return found;
}

absl::Status RpcCall::MustBeOperator(absl::string_view what) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  return Logged(authorizer_->MustBeOperator(caller_, what), what);
}

absl::Status RpcCall::MayAttach(uid_t uid, gid_t gid, const std::vector<gid_t>& groups) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  return authorizer_->MayAttach(uid, gid, groups);
}

absl::StatusOr<uint32_t> RpcCall::CheckpointOwner(std::optional<uint32_t> uid) const {
  const bool own = caller_.known && (!uid.has_value() || *uid == caller_.uid);
  if (authorizer_ == nullptr || own) return uid.has_value() ? *uid : caller_.uid;
  if (!uid.has_value()) {
    return absl::InvalidArgumentError(
        "checkpoint delete: the caller has no kernel identity (TCP), so it names no folder; "
        "set uid (and be an operator: --tcp_operator_calls)");
  }
  if (authorizer_->IsOperator(caller_)) return *uid;
  return Logged(
      absl::PermissionDeniedError(absl::StrCat(
          "checkpoint delete: the checkpoints of uid ", *uid, " are theirs; ",
          caller_.known ? absl::StrCat("uid ", caller_.uid) : std::string("a TCP caller"),
          " may delete only its own (leave uid unset) unless it is an operator (root, dosd's uid "
          "or a member of --operator_gids", caller_.known ? "" : "; TCP: --tcp_operator_calls",
          ")")),
      "delete checkpoint");
}

}  // namespace dos
