// RpcCall and ServeCall: the one wrapper around every DosService handler.
//
// A gRPC method of DosService is one line: ServeCall builds the call's
// RpcCall (who called, from the kernel, looked up once per call), checks the
// rights the method needs before anything else (CallRights), runs the
// handler, which returns an absl::Status, and converts that status to the
// call's grpc::Status (grpc_status.h), here and nowhere else. Rights that
// depend on what the request names (a session, every session, a uid's
// checkpoint folder) are checked by the handler through the RpcCall, which
// logs every refusal (auth.call_refused) in one place.
//
// Without an Authorizer (in-process tests and fuzzers of the adapter only;
// dosd always has one) every check passes, as DosService's constructor says.
//
// Thread-safety: an RpcCall is built and used by one handler thread; the
// Authorizer it points to is thread-safe and outlives it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/rpc/caller_identity.h"
#include "daemon/rpc/grpc_status.h"
#include "daemon/session/session.h"

namespace dos {

// What a method requires of its caller before its handler runs.
enum class CallRights {
  kAnyone,  // reads, or the handler checks what the request names (RpcCall)
  kLocal,   // kernel credentials (Attach: over the unix socket, not TCP)
  kMember,  // the session list: kernel credentials, or an operator over TCP
};

class RpcCall {
 public:
  // `authorizer` may be null: no checks (see above).
  RpcCall(CallerIdentity caller, const Authorizer* authorizer)
      : caller_(std::move(caller)), authorizer_(authorizer) {}

  const CallerIdentity& caller() const { return caller_; }
  // False without an Authorizer: nothing is checked.
  bool checked() const { return authorizer_ != nullptr; }

  // OK if the caller has `rights` (PERMISSION_DENIED naming what is missing
  // and the fix otherwise). ServeCall calls it before the handler.
  absl::Status Admit(CallRights rights, absl::string_view what) const;
  // OK if the caller may act on `s` (its owner or an operator); `what` names
  // the call in the message and the log.
  absl::Status MayActOn(const Session& s, absl::string_view what) const;
  // The session a lookup found, if the caller may act on it: the lookup's
  // error first, then the rights.
  absl::StatusOr<std::shared_ptr<Session>> MayActOn(
      absl::StatusOr<std::shared_ptr<Session>> found, absl::string_view what) const;
  // OK for operators only (calls on every session, the default policy).
  absl::Status MustBeOperator(absl::string_view what) const;
  // OK if a process of (uid, gid, groups) may attach (--allow_uids /
  // --allow_gids); the caller logs the refusal with the pid.
  absl::Status MayAttach(uid_t uid, gid_t gid, const std::vector<gid_t>& groups) const;
  // Whose checkpoint folder a DeleteCheckpoint acts on: the caller's own
  // (`uid` unset or the caller's), or, for operators, `uid`.
  // INVALID_ARGUMENT for a caller without identity naming no uid;
  // PERMISSION_DENIED naming both uids and the fix otherwise.
  absl::StatusOr<uint32_t> CheckpointOwner(std::optional<uint32_t> uid) const;

 private:
  // `st` unchanged; a refusal is logged (auth.call_refused).
  absl::Status Logged(absl::Status st, absl::string_view what) const;

  const CallerIdentity caller_;
  const Authorizer* const authorizer_;
};

// The wrapper: Admit, then `handler(call)` (an absl::Status), converted to
// the call's grpc::Status. `what` names the method in a refusal.
template <typename Handler>
grpc::Status ServeCall(const RpcCall& call, CallRights rights, absl::string_view what,
                       Handler&& handler) {
  absl::Status st = call.Admit(rights, what);
  if (st.ok()) st = std::forward<Handler>(handler)(call);
  return ToGrpcStatus(st);
}

}  // namespace dos
