// DosService: the gRPC adapter of dos.v1.Dos (proto/dos/v1/dos.proto).
//
// Handlers translate protobuf messages into the daemon's plain types,
// validate what the wire can get wrong (enum values, missing fields, counts),
// call the SessionManager and reply. They never run optimizer math or wait
// for a step: steps travel through the control block, not through here.
//
// Thread-safety: gRPC calls handlers from its own thread pool; all state is
// in the thread-safe SessionManager and HostMemoryBudget.
#pragma once

#include "absl/time/time.h"
#include "daemon/rpc/caller_identity.h"
#include "daemon/session/checkpointer.h"
#include "daemon/session/session_manager.h"
#include "daemon/transport/fd_server.h"
#include "daemon/state/host_memory_budget.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace dos {

class DosService final : public v1::Dos::Service {
 public:
  // `checkpointer` may be null: checkpoints are off and the checkpoint calls
  // answer FAILED_PRECONDITION with `checkpoints_off` (why, and the fix).
  // `descriptors` (the descriptor socket) may be null only in-process
  // (tests, fuzzers): Attach then trusts the claimed pid; dosd always passes
  // it, and Attach requires its ticket. `peers` and `authorizer` may be null: no per-call identity
  // check (in-process tests of the adapter only); dosd passes both, and each
  // call's kernel identity decides what it may touch (caller_identity.h),
  // Attach's also whether it may attach (--allow_uids / --allow_gids).
  DosService(SessionManager* sessions, HostMemoryBudget* budget, std::string version,
             Checkpointer* checkpointer = nullptr, DescriptorServer* descriptors = nullptr,
             const PeerTable* peers = nullptr, const Authorizer* authorizer = nullptr,
             std::string checkpoints_off = "this dosd has no checkpointer")
      : sessions_(sessions),
        budget_(budget),
        version_(std::move(version)),
        checkpointer_(checkpointer),
        descriptors_(descriptors),
        peers_(peers),
        authorizer_(authorizer),
        checkpoints_off_(std::move(checkpoints_off)) {}

  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::AttachResponse*) override;
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest*, v1::DetachResponse*) override;
  grpc::Status RegisterShard(grpc::ServerContext*, const v1::RegisterShardRequest*,
                             v1::RegisterShardResponse*) override;
  grpc::Status GetPolicy(grpc::ServerContext*, const v1::GetPolicyRequest*,
                         v1::GetPolicyResponse*) override;
  grpc::Status SetPolicy(grpc::ServerContext*, const v1::SetPolicyRequest*,
                         v1::SetPolicyResponse*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                        v1::GetStatsResponse*) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse*) override;
  grpc::Status ExportState(grpc::ServerContext*, const v1::TransferStateRequest*,
                           v1::TransferStateResponse*) override;
  grpc::Status ImportState(grpc::ServerContext*, const v1::TransferStateRequest*,
                           v1::TransferStateResponse*) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest*,
                              v1::SaveCheckpointResponse*) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext*, const v1::LoadCheckpointRequest*,
                              v1::LoadCheckpointResponse*) override;
  // checkpoint_calls.cc, as are Save/LoadCheckpoint.
  grpc::Status DeleteCheckpoint(grpc::ServerContext*, const v1::DeleteCheckpointRequest*,
                                v1::DeleteCheckpointResponse*) override;

 private:
  SessionManager* const sessions_;
  HostMemoryBudget* const budget_;
  const std::string version_;
  Checkpointer* const checkpointer_;
  DescriptorServer* const descriptors_;
  const PeerTable* const peers_;
  const Authorizer* const authorizer_;
  const std::string checkpoints_off_;  // why checkpointer_ is null

  CallerIdentity Caller(const grpc::ServerContext* ctx) const;
  // OK if the caller may act on `s` (its owner or an operator).
  absl::Status MayActOn(const grpc::ServerContext* ctx, const Session& s,
                        absl::string_view what) const;
  absl::Status MustBeOperator(const grpc::ServerContext* ctx, absl::string_view what) const;
  // Whose folder a DeleteCheckpoint names: the caller's own, or (operators)
  // the uid it gives; PERMISSION_DENIED naming both and the fix otherwise.
  absl::StatusOr<uint32_t> DeleteOwner(const grpc::ServerContext* ctx,
                                       const v1::DeleteCheckpointRequest& req) const;
  // GetStats: each uid's checkpoint bytes and the quota.
  void FillCheckpointUsage(v1::GetStatsResponse* resp) const;
  // ListSessions names jobs and pids: not to TCP callers unless operators.
  absl::Status MayListSessions(const grpc::ServerContext* ctx) const;
  // FAILED_PRECONDITION for a checkpoint call while checkpoints are off.
  grpc::Status CheckpointsOff() const;
  const absl::Time started_ = absl::Now();
};

}  // namespace dos
