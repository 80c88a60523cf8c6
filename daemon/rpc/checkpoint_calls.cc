// DosService's checkpoint calls (SaveCheckpoint, LoadCheckpoint,
// DeleteCheckpoint) and the store's part of GetStats; see dos_service.h.
#include <optional>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/rpc/dos_service.h"
#include "daemon/rpc/session_lookup.h"
#include "dos/wire/status_macros.h"

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

absl::StatusOr<DosService::CheckpointSlot> DosService::TakeCheckpointSlot(
    const RpcCall& call, absl::string_view what) const {
  const int64_t uid = call.caller().known ? static_cast<int64_t>(call.caller().uid) : -1;
  absl::MutexLock lock(&slots_mu_);
  int& calls = checkpoint_calls_[uid];
  if (calls >= kCheckpointCallsPerUid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ",
        uid < 0 ? std::string("callers without kernel credentials") : absl::StrCat("uid ", uid),
        " already has ", calls, " checkpoint calls queued or running (at most ",
        kCheckpointCallsPerUid,
        " per uid: dosd has one checkpoint writer for every user of the "
        "node); wait for them to finish, then call again"));
  }
  ++calls;
  return CheckpointSlot([this, uid] {
    absl::MutexLock lock(&slots_mu_);
    if (--checkpoint_calls_[uid] == 0) checkpoint_calls_.erase(uid);
  });
}

absl::Status DosService::CheckpointsOff() const {
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoints are off in this dosd: ", checkpoints_off_));
}

grpc::Status DosService::SaveCheckpoint(ServerContext* ctx, const v1::SaveCheckpointRequest* req,
                                        v1::SaveCheckpointResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleSaveCheckpoint, "save checkpoint");
}
grpc::Status DosService::LoadCheckpoint(ServerContext* ctx, const v1::LoadCheckpointRequest* req,
                                        v1::LoadCheckpointResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleLoadCheckpoint, "load checkpoint");
}
grpc::Status DosService::DeleteCheckpoint(ServerContext* ctx,
                                          const v1::DeleteCheckpointRequest* req,
                                          v1::DeleteCheckpointResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleDeleteCheckpoint, "delete checkpoint");
}

absl::Status DosService::HandleSaveCheckpoint(const RpcCall& call,
                                              const v1::SaveCheckpointRequest& req,
                                              v1::SaveCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  DOS_ASSIGN_OR_RETURN(CheckpointSlot slot, TakeCheckpointSlot(call, "save checkpoint"));
  if (req.session_id() == 0) {
    DOS_RETURN_IF_ERROR(call.MustBeOperator("save checkpoint of every session"));
  } else {
    DOS_RETURN_IF_ERROR(
        call.MayActOn(FindLiveOrOrphan(*sessions_, req.session_id()), "save checkpoint")
            .status());
  }
  // Save() resolves the path under the session owner's folder (once).
  DOS_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> saved,
                       checkpointer_->Save(req.session_id(), req.path()));
  if (!saved.empty()) resp->set_path(saved.front().path);
  FillRecords(saved, resp->mutable_files());
  return absl::OkStatus();
}

absl::Status DosService::HandleLoadCheckpoint(const RpcCall& call,
                                              const v1::LoadCheckpointRequest& req,
                                              v1::LoadCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  DOS_ASSIGN_OR_RETURN(CheckpointSlot slot, TakeCheckpointSlot(call, "load checkpoint"));
  if (req.path().empty()) {
    return absl::InvalidArgumentError(
        "path is empty; name a checkpoint file or directory in the session owner's folder "
        "under dosd's --checkpoint_dir");
  }
  std::shared_ptr<Session> session;  // null: every session (operators)
  if (req.session().session_id() != 0) {
    DOS_ASSIGN_OR_RETURN(
        session,
        call.MayActOn(FindSessionOrOperator(*sessions_, req.session()), "load checkpoint"));
  } else {
    DOS_RETURN_IF_ERROR(call.MustBeOperator("load checkpoints into every session"));
  }
  // Load() resolves the path under the session owner's folder (once).
  DOS_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> loaded,
                       checkpointer_->Load(std::move(session), req.path()));
  FillRecords(loaded, resp->mutable_files());
  return absl::OkStatus();
}

absl::Status DosService::HandleDeleteCheckpoint(const RpcCall& call,
                                                const v1::DeleteCheckpointRequest& req,
                                                v1::DeleteCheckpointResponse* resp) {
  if (checkpointer_ == nullptr) return CheckpointsOff();
  DOS_ASSIGN_OR_RETURN(CheckpointSlot slot, TakeCheckpointSlot(call, "delete checkpoint"));
  DOS_ASSIGN_OR_RETURN(const uint32_t owner,
                       call.CheckpointOwner(req.has_uid() ? std::optional<uint32_t>(req.uid())
                                                          : std::nullopt));
  if (req.path().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint delete: path is empty; name a file or folder in uid ", owner,
        "'s checkpoint folder (\".\": all of them)"));
  }
  DOS_ASSIGN_OR_RETURN(std::string path, checkpointer_->Resolve(owner, req.path(), "path"));
  DOS_ASSIGN_OR_RETURN(UserFolders::Deleted deleted, checkpointer_->Delete(owner, path));
  for (const std::string& p : deleted.paths) resp->add_paths(p);
  resp->set_bytes(deleted.bytes);
  resp->mutable_usage()->set_uid(owner);
  const auto usage = checkpointer_->Usage();
  if (auto it = usage.find(owner); it != usage.end()) {
    resp->mutable_usage()->set_bytes(it->second.bytes);
    resp->mutable_usage()->set_files(it->second.files);
  }
  return absl::OkStatus();
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

}  // namespace dos
