// DosService's checkpoint calls (SaveCheckpoint, LoadCheckpoint,
// DeleteCheckpoint) and the store's part of GetStats; see dos_service.h.
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/rpc/dos_service.h"
#include "daemon/rpc/grpc_status.h"
#include "daemon/rpc/session_lookup.h"

namespace dos {

using grpc::ServerContext;

namespace {
void FillRecords(const std::vector<CheckpointRecord>& records,
                 google::protobuf::RepeatedPtrField<v1::CheckpointFile>* out) {
  for (const CheckpointRecord& r : records) {
    v1::CheckpointFile* f = out->Add();
    f->set_session_id(r.session_id);
    f->set_path(r.path);
    f->set_step(r.step);
    f->set_bytes(r.bytes);
    f->set_snapshot_us(r.snapshot_us);
    f->set_write_ms(r.write_ms);
    f->set_last_step_wall_us(r.last_step_wall_us);
    f->set_copy_ms(r.copy_ms);
    f->set_subgroups_copied_by_steps(r.subgroups_copied_by_steps);
  }
}
}  // namespace

grpc::Status DosService::CheckpointsOff() const {
  return ToGrpcStatus(absl::FailedPreconditionError(
      absl::StrCat("checkpoints are off in this dosd: ", checkpoints_off_)));
}

grpc::Status DosService::SaveCheckpoint(ServerContext* ctx, const v1::SaveCheckpointRequest* req,
                                        v1::SaveCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  if (req->session_id() == 0) {
    if (absl::Status st = MustBeOperator(ctx, "save checkpoint of every session"); !st.ok()) {
      return ToGrpcStatus(st);
    }
  } else {
    absl::StatusOr<std::shared_ptr<Session>> s = FindLiveOrOrphan(*sessions_, req->session_id());
    if (!s.ok()) return ToGrpcStatus(s.status());
    if (absl::Status st = MayActOn(ctx, **s, "save checkpoint"); !st.ok()) return ToGrpcStatus(st);
    if (!req->path().empty()) {
      absl::StatusOr<std::string> p =
          checkpointer_->Resolve((*s)->identity().uid, req->path(), "path");
      if (!p.ok()) return ToGrpcStatus(p.status());
    }
  }
  absl::StatusOr<std::vector<CheckpointRecord>> saved =
      checkpointer_->Save(req->session_id(), req->path());
  if (!saved.ok()) return ToGrpcStatus(saved.status());
  if (!saved->empty()) resp->set_path(saved->front().path);
  FillRecords(*saved, resp->mutable_files());
  return grpc::Status::OK;
}

grpc::Status DosService::LoadCheckpoint(ServerContext* ctx, const v1::LoadCheckpointRequest* req,
                                        v1::LoadCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  if (req->path().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "path is empty; name a checkpoint file or directory in the session owner's folder "
        "under dosd's --checkpoint_dir"));
  }
  std::shared_ptr<Session> session;
  if (req->session().session_id() != 0) {
    absl::StatusOr<std::shared_ptr<Session>> s =
        FindSessionOrOperator(*sessions_, req->session());
    if (!s.ok()) return ToGrpcStatus(s.status());
    if (absl::Status st = MayActOn(ctx, **s, "load checkpoint"); !st.ok()) return ToGrpcStatus(st);
    if (absl::StatusOr<std::string> p =
            checkpointer_->Resolve((*s)->identity().uid, req->path(), "path");
        !p.ok()) {
      return ToGrpcStatus(p.status());
    }
    session = *std::move(s);
  } else if (absl::Status st = MustBeOperator(ctx, "load checkpoints into every session");
             !st.ok()) {
    return ToGrpcStatus(st);
  }
  absl::StatusOr<std::vector<CheckpointRecord>> loaded =
      checkpointer_->Load(std::move(session), req->path());
  if (!loaded.ok()) return ToGrpcStatus(loaded.status());
  FillRecords(*loaded, resp->mutable_files());
  return grpc::Status::OK;
}

grpc::Status DosService::DeleteCheckpoint(ServerContext* ctx,
                                          const v1::DeleteCheckpointRequest* req,
                                          v1::DeleteCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  absl::StatusOr<uint32_t> owner = DeleteOwner(ctx, *req);
  if (!owner.ok()) return ToGrpcStatus(owner.status());
  if (req->path().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "checkpoint delete: path is empty; name a file or folder in uid ", *owner,
        "'s checkpoint folder (\".\": all of them)")));
  }
  absl::StatusOr<std::string> path = checkpointer_->Resolve(*owner, req->path(), "path");
  if (!path.ok()) return ToGrpcStatus(path.status());
  absl::StatusOr<UserFolders::Deleted> deleted = checkpointer_->Delete(*owner, *path);
  if (!deleted.ok()) return ToGrpcStatus(deleted.status());
  for (const std::string& p : deleted->paths) resp->add_paths(p);
  resp->set_bytes(deleted->bytes);
  resp->mutable_usage()->set_uid(*owner);
  const auto usage = checkpointer_->Usage();
  if (auto it = usage.find(*owner); it != usage.end()) {
    resp->mutable_usage()->set_bytes(it->second.bytes);
    resp->mutable_usage()->set_files(it->second.files);
  }
  return grpc::Status::OK;
}

absl::StatusOr<uint32_t> DosService::DeleteOwner(const ServerContext* ctx,
                                                 const v1::DeleteCheckpointRequest& req) const {
  const CallerIdentity caller = Caller(ctx);
  const bool own = caller.known && (!req.has_uid() || req.uid() == caller.uid);
  if (authorizer_ == nullptr || own) return req.has_uid() ? req.uid() : caller.uid;
  if (!req.has_uid()) {
    return absl::InvalidArgumentError(
        "checkpoint delete: the caller has no kernel identity (TCP), so it names no folder; "
        "set uid (and be an operator: --tcp_operator_calls)");
  }
  if (authorizer_->IsOperator(caller)) return req.uid();
  absl::Status st = absl::PermissionDeniedError(absl::StrCat(
      "checkpoint delete: the checkpoints of uid ", req.uid(), " are theirs; ",
      caller.known ? absl::StrCat("uid ", caller.uid) : std::string("a TCP caller"),
      " may delete only its own (leave uid unset) unless it is an operator (root, dosd's uid or "
      "a member of --operator_gids", caller.known ? "" : "; TCP: --tcp_operator_calls", ")"));
  DOS_LOG_WARNING("auth.call_refused", "call", "delete checkpoint", "error", st.message());
  return st;
}

void DosService::FillCheckpointUsage(v1::GetStatsResponse* resp) const {
  if (checkpointer_ == nullptr) return;
  resp->set_checkpoint_quota_bytes(checkpointer_->quota());
  for (const auto& [uid, u] : checkpointer_->Usage()) {
    v1::CheckpointUsage* out = resp->add_checkpoint_usage();
    out->set_uid(uid);
    out->set_bytes(u.bytes);
    out->set_files(u.files);
  }
}

absl::Status DosService::MayListSessions(const ServerContext* ctx) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  const CallerIdentity caller = Caller(ctx);
  // The socket's file mode keeps outsiders off the unix socket; a TCP port
  // does not, so job names and pids go only to operators there.
  if (caller.known || authorizer_->IsOperator(caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "sessions: callers over the TCP listener carry no identity, and the session list (job "
      "names, pids) is for the trainers' group; use dosd's unix socket as a member of its "
      "group, or start dosd with --tcp_operator_calls (TCP callers are then operators)");
}

}  // namespace dos
