// DosService: the gRPC adapter of dos.v1.Dos (proto/dos/v1/dos.proto).
//
// Handlers translate protobuf messages into the daemon's plain types,
// validate what the wire can get wrong (enum values, missing fields, counts),
// call the SessionManager and reply. They never run optimizer math or wait
// for a step: steps travel through the control block, not through here.
// Every method goes through one wrapper (Serve, rpc_call.h) that checks the
// caller's rights and converts the handler's absl::Status to gRPC's.
//
// Long calls: RegisterShard, SaveCheckpoint and LoadCheckpoint block their
// handler thread for as long as their work takes (each handler says how
// long). gRPC's synchronous server (dosd sets no thread quota) adds threads
// as calls need them, so a long call delays no other call, and no step
// (steps do not travel through gRPC). What bounds them: a session registers
// once (a second RegisterShard fails at once), so registrations in flight
// are at most the sessions held (--max_sessions, --max_sessions_per_uid),
// each as long as its state's bytes take (--session_memory_limit,
// --host_memory_limit); saves run one at a time on the checkpointer's
// thread, in order (concurrent saves queue there, each holding one handler
// thread while it waits; at most kCheckpointCallsPerUid checkpoint calls of
// one uid at once); loads run on their handler thread.
//
// Thread-safety: gRPC calls handlers from its own thread pool; all state is
// in the thread-safe SessionManager and HostMemoryBudget.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/rpc/caller_identity.h"
#include "daemon/rpc/rpc_call.h"
#include "daemon/session/checkpointer.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/transport/fd_server.h"
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

  // Each method is one line: Serve (rpc_call.h) checks the caller's rights,
  // runs the handler below and converts its status.
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
  // checkpoint_calls.cc: Save/Load/DeleteCheckpoint.
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest*,
                              v1::SaveCheckpointResponse*) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext*, const v1::LoadCheckpointRequest*,
                              v1::LoadCheckpointResponse*) override;
  grpc::Status DeleteCheckpoint(grpc::ServerContext*, const v1::DeleteCheckpointRequest*,
                                v1::DeleteCheckpointResponse*) override;

 private:
  template <typename Request, typename Response>
  using Handler = absl::Status (DosService::*)(const RpcCall&, const Request&, Response*);

  // The wrapper of every method: the call's identity (once), `rights`,
  // `handler`, the status converted (rpc_call.h). `what` names the call in a
  // refusal of `rights`.
  template <typename Request, typename Response>
  grpc::Status Serve(const grpc::ServerContext* ctx, const Request* req, Response* resp,
                     Handler<Request, Response> handler, absl::string_view what,
                     CallRights rights = CallRights::kAnyone) {
    return ServeCall(CallOf(ctx), rights, what,
                     [&](const RpcCall& call) { return (this->*handler)(call, *req, resp); });
  }
  // Who is calling (unknown without a PeerTable: then `ctx` may be null).
  RpcCall CallOf(const grpc::ServerContext* ctx) const;

  // The handlers. Each validates what the wire can get wrong, checks the
  // rights on what the request names through `call`, calls the
  // SessionManager or the Checkpointer and fills the response.
  absl::Status HandleAttach(const RpcCall& call, const v1::AttachRequest& req,
                            v1::AttachResponse* resp);
  absl::Status HandleDetach(const RpcCall& call, const v1::DetachRequest& req,
                            v1::DetachResponse* resp);
  // Blocks its handler thread while the state is allocated, pinned and
  // filled (and, on a re-attach, restored from a checkpoint): bounded by the
  // session's tensors' bytes (--session_memory_limit, --host_memory_limit)
  // at memory and disk speed; once per session, at the trainer's start-up.
  absl::Status HandleRegisterShard(const RpcCall& call, const v1::RegisterShardRequest& req,
                                   v1::RegisterShardResponse* resp);
  absl::Status HandleGetPolicy(const RpcCall& call, const v1::GetPolicyRequest& req,
                               v1::GetPolicyResponse* resp);
  absl::Status HandleSetPolicy(const RpcCall& call, const v1::SetPolicyRequest& req,
                               v1::SetPolicyResponse* resp);
  absl::Status HandleGetStats(const RpcCall& call, const v1::GetStatsRequest& req,
                              v1::GetStatsResponse* resp);
  absl::Status HandleListSessions(const RpcCall& call, const v1::ListSessionsRequest& req,
                                  v1::ListSessionsResponse* resp);
  absl::Status HandleExportState(const RpcCall& call, const v1::TransferStateRequest& req,
                                 v1::TransferStateResponse* resp);
  absl::Status HandleImportState(const RpcCall& call, const v1::TransferStateRequest& req,
                                 v1::TransferStateResponse* resp);
  // Blocks its handler thread until the checkpointer's one writer thread has
  // written the file(s) (Checkpointer::Save says how long); training goes on.
  absl::Status HandleSaveCheckpoint(const RpcCall& call, const v1::SaveCheckpointRequest& req,
                                    v1::SaveCheckpointResponse* resp);
  // Blocks its handler thread while the file is read and verified
  // (Checkpointer::Load).
  absl::Status HandleLoadCheckpoint(const RpcCall& call, const v1::LoadCheckpointRequest& req,
                                    v1::LoadCheckpointResponse* resp);
  absl::Status HandleDeleteCheckpoint(const RpcCall& call,
                                      const v1::DeleteCheckpointRequest& req,
                                      v1::DeleteCheckpointResponse* resp);

  // Attach's steps: the attaching process as the kernel knows it (null
  // in-process, without a descriptor socket) after the allow lists; the
  // session's identity from it and the request.
  absl::StatusOr<std::shared_ptr<const PeerProcess>> AttachingProcess(
      const RpcCall& call, const v1::AttachRequest& req) const;
  absl::StatusOr<SessionIdentity> AttachIdentity(const RpcCall& call,
                                                 const v1::AttachRequest& req,
                                                 std::shared_ptr<const PeerProcess> process) const;
  // GetStats: each uid's checkpoint bytes and the quota.
  void FillCheckpointUsage(v1::GetStatsResponse* resp) const;
  // FAILED_PRECONDITION for a checkpoint call while checkpoints are off.
  absl::Status CheckpointsOff() const;
  // A checkpoint call's place among its caller's: at most
  // kCheckpointCallsPerUid of one uid (callers without kernel credentials
  // count as one) queued or running at once, since one writer serves every
  // user of the node (a rank each for a node's 8 GPUs); RESOURCE_EXHAUSTED
  // naming the uid and what to do beyond that (an operator's calls count
  // under the operator's uid). Given back when the returned object is destroyed.
  static constexpr int kCheckpointCallsPerUid = 8;
  class CheckpointSlot {
   public:
    explicit CheckpointSlot(std::function<void()> release) : release_(std::move(release)) {}
    CheckpointSlot(CheckpointSlot&& o) noexcept : release_(std::exchange(o.release_, nullptr)) {}
    CheckpointSlot& operator=(CheckpointSlot&&) = delete;
    ~CheckpointSlot() {
      if (release_) release_();
    }

   private:
    std::function<void()> release_;
  };
  absl::StatusOr<CheckpointSlot> TakeCheckpointSlot(const RpcCall& call,
                                                    absl::string_view what) const;

  SessionManager* const sessions_;
  HostMemoryBudget* const budget_;
  const std::string version_;
  Checkpointer* const checkpointer_;
  DescriptorServer* const descriptors_;
  const PeerTable* const peers_;
  const Authorizer* const authorizer_;
  const std::string checkpoints_off_;  // why checkpointer_ is null
  mutable absl::Mutex slots_mu_;
  mutable std::map<int64_t, int> checkpoint_calls_ ABSL_GUARDED_BY(slots_mu_);  // by uid (-1)
  const absl::Time started_ = absl::Now();
};

}  // namespace dos
