#include "daemon/rpc/dos_service.h"

#include <unistd.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/rpc/session_lookup.h"
#include "daemon/rpc/step_stats.h"
#include "daemon/rpc/uid_usage.h"
#include "dos/wire/control_block.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

using grpc::ServerContext;

// Largest step count ImportState accepts: far beyond any run, and the step
// counter (int64) can still count on for as long as anyone trains.
constexpr int64_t kMaxImportedStep = int64_t{1} << 53;

absl::StatusOr<DType> ToDType(v1::DType d, absl::string_view field) {
  if (!IsValidDType(static_cast<uint32_t>(d))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", v1::DType_Name(d),
                     "; supported dtypes are DTYPE_F32, DTYPE_BF16 and DTYPE_F16"));
  }
  return static_cast<DType>(d);
}

// Shared memory travels by descriptor only: a name is refused (dosd would
// open it with its own rights: a confused deputy), an id must be set.
absl::StatusOr<MemoryRef> ToSegmentRef(const v1::ShmLocation& shm, absl::string_view field) {
  if (!shm.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shm.name is set (\"", shm.name().substr(0, 64),
        "\"); dosd maps no memory by name: send the buffer's sealed memfd over the descriptor "
        "socket (<socket>.fd) and set shm.segment to the id it answers"));
  }
  if (shm.segment() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shm.segment is 0; set it to the id the descriptor socket answered for the "
        "buffer's memfd"));
  }
  return SegmentRef(shm.segment(), shm.offset());
}

absl::StatusOr<MemoryRef> ToMemoryRef(const v1::MemoryLocation& loc, absl::string_view field) {
  if (loc.has_cuda_ipc()) {
    const v1::CudaIpcLocation& c = loc.cuda_ipc();
    if (c.handle().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".cuda_ipc.handle is empty"));
    }
    MemoryRef ref;
    ref.offset = c.offset();
    ref.cuda_ipc_handle = c.handle();
    ref.alloc_bytes = c.alloc_bytes();
    ref.device_uuid = c.device_uuid();
    return ref;
  }
  if (!loc.has_shm()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has no location; set shm"));
  }
  return ToSegmentRef(loc.shm(), field);
}

absl::StatusOr<ShardSpec> ToShardSpec(const v1::RegisterShardRequest& req) {
  ShardSpec spec;
  spec.subgroup_size = req.subgroup_size();
  spec.cuda_ipc_event = req.cuda_ipc_event();
  if (!IsValidStateFormat(static_cast<uint32_t>(req.state_format()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "register: state_format ", static_cast<int>(req.state_format()),
        " is not a StateFormat; send STATE_FORMAT_FP32 (0) or STATE_FORMAT_COMPACT (1)"));
  }
  spec.state_format = static_cast<StateFormat>(req.state_format());
  for (int i = 0; i < req.groups_size(); ++i) {
    const v1::Hyperparameters& h = req.groups(i);
    GroupConfig g;
    g.defaults = GroupStepParams{h.lr(), h.beta1(), h.beta2(), h.eps(), h.weight_decay()};
    g.decoupled_weight_decay = h.decoupled_weight_decay();
    spec.groups.push_back(g);
  }
  for (int i = 0; i < req.tensors_size(); ++i) {
    const v1::TensorSpec& t = req.tensors(i);
    std::string field = absl::StrCat("register: tensors[", i, "]");
    TensorSpec out;
    out.desc.name = t.name();
    out.desc.numel = t.numel();
    out.desc.group = t.group();
    absl::StatusOr<DType> pd = ToDType(t.param_dtype(), field + ".param_dtype");
    if (!pd.ok()) return pd.status();
    absl::StatusOr<DType> gd = ToDType(t.grad_dtype(), field + ".grad_dtype");
    if (!gd.ok()) return gd.status();
    out.desc.param_dtype = *pd;
    out.desc.grad_dtype = *gd;
    absl::StatusOr<MemoryRef> p = ToMemoryRef(t.param(), field + ".param");
    if (!p.ok()) return p.status();
    absl::StatusOr<MemoryRef> g = ToMemoryRef(t.grad(), field + ".grad");
    if (!g.ok()) return g.status();
    out.param = *p;
    out.grad = *g;
    spec.tensors.push_back(std::move(out));
  }
  return spec;
}

// "cuda:<ordinal>", "host" or "" (not registered).
std::string DeviceName(const Session::Summary& sum) {
  if (!sum.registered) return "";
  return sum.gpu_device >= 0 ? absl::StrCat("cuda:", sum.gpu_device) : "host";
}

void FillSessionStats(const Session& s, v1::SessionStats* out) {
  SessionStatsSnapshot st = s.stats();
  Session::Summary sum = s.summary();
  out->set_session_id(s.identity().id);
  out->set_device(DeviceName(sum));
  out->set_steps(st.steps);
  out->set_skipped_steps(st.skipped_steps);
  out->set_params(sum.params);
  out->set_lock_wait_us_max(st.lock_wait_us_max);
  out->set_lock_wait_us_total(st.lock_wait_us_total);
  out->set_snapshot_wait_us_max(st.snapshot_wait_us_max);
  out->set_snapshot_wait_us_total(st.snapshot_wait_us_total);
  if (st.last.update_us > 0 && !st.last.found_inf) {
    out->set_params_per_second(static_cast<double>(sum.params) / (st.last.update_us * 1e-6));
  }
  FillStepStats(st.last, st.last_wall_us, out->mutable_last_step());
}

// Attach from a client of another protocol: both versions, which side is
// older, and what to install.
absl::Status VersionMismatch(absl::string_view client_version, uint32_t client_protocol,
                             absl::string_view daemon_version) {
  const std::string client =
      client_version.empty() ? std::string("a client library older than DOS 0.1.0")
                             : absl::StrCat("libdos_client ", client_version);
  const bool older = client_protocol < kProtocolVersion;
  return absl::FailedPreconditionError(absl::StrCat(
      "attach: ", client, " (protocol ", client_protocol, ") cannot work with dosd ",
      daemon_version, " (protocol ", kProtocolVersion, "): the client is ",
      older ? "older" : "newer", " than the daemon. ",
      older ? absl::StrCat("Upgrade the trainer's DOS client to ", daemon_version,
                           " (pip install dos-optimizer==", daemon_version,
                           ", or the dos package's libdos_client) or run a dosd as old as it")
            : absl::StrCat("Upgrade dosd on this node to the client's release (install the "
                           "dos package of ", client_version.empty() ? "it" : client_version,
                           ", then systemctl restart dosd) or use a DOS client ",
                           daemon_version)));
}

}  // namespace

RpcCall DosService::CallOf(const grpc::ServerContext* ctx) const {
  return RpcCall(peers_ != nullptr ? peers_->Lookup(ctx->peer()) : CallerIdentity{}, authorizer_);
}

grpc::Status DosService::Attach(ServerContext* ctx, const v1::AttachRequest* req,
                                v1::AttachResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleAttach, "attach", CallRights::kLocal);
}
grpc::Status DosService::Detach(ServerContext* ctx, const v1::DetachRequest* req,
                                v1::DetachResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleDetach, "detach");
}
grpc::Status DosService::RegisterShard(ServerContext* ctx, const v1::RegisterShardRequest* req,
                                       v1::RegisterShardResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleRegisterShard, "register");
}
grpc::Status DosService::GetPolicy(ServerContext* ctx, const v1::GetPolicyRequest* req,
                                   v1::GetPolicyResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleGetPolicy, "get policy");
}
grpc::Status DosService::SetPolicy(ServerContext* ctx, const v1::SetPolicyRequest* req,
                                   v1::SetPolicyResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleSetPolicy, "set policy");
}
grpc::Status DosService::GetStats(ServerContext* ctx, const v1::GetStatsRequest* req,
                                  v1::GetStatsResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleGetStats, "stats");
}
grpc::Status DosService::ListSessions(ServerContext* ctx, const v1::ListSessionsRequest* req,
                                      v1::ListSessionsResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleListSessions, "sessions", CallRights::kMember);
}
grpc::Status DosService::ExportState(ServerContext* ctx, const v1::TransferStateRequest* req,
                                     v1::TransferStateResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleExportState, "export state");
}
grpc::Status DosService::ImportState(ServerContext* ctx, const v1::TransferStateRequest* req,
                                     v1::TransferStateResponse* resp) {
  return Serve(ctx, req, resp, &DosService::HandleImportState, "import state");
}

// Who attaches, from the kernel (the descriptor socket's Hello), not from
// the pid the request claims: a trainer in a pid namespace claims its
// namespace's pid. Then the allow lists, on the attaching process's
// credentials as the kernel gave them at its Hello (else, in-process only,
// the gRPC connection's).
absl::StatusOr<std::shared_ptr<const PeerProcess>> DosService::AttachingProcess(
    const RpcCall& call, const v1::AttachRequest& req) const {
  std::shared_ptr<const PeerProcess> process;
  if (descriptors_ != nullptr) {
    absl::StatusOr<std::shared_ptr<const PeerProcess>> p = descriptors_->Redeem(req.fd_ticket());
    if (!p.ok()) {
      DOS_LOG_WARNING("auth.attach_refused", "pid", req.pid(), "error", p.status().message());
      return p.status();
    }
    process = *std::move(p);
  }
  const CallerIdentity& caller = call.caller();
  absl::Status st = process != nullptr
                        ? call.MayAttach(process->uid(), process->gid(), process->groups())
                        : call.MayAttach(caller.uid, caller.gid, caller.groups);
  if (!st.ok()) {
    DOS_LOG_WARNING("auth.attach_refused", "pid", process != nullptr ? process->pid() : req.pid(),
                    "error", st.message());
    return st;
  }
  return process;
}

namespace {
// What the wire can get wrong in an Attach's name and rank.
absl::Status CheckAttachNameAndRank(const v1::AttachRequest& req) {
  if (req.client_name().size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attach: client_name has ", req.client_name().size(), " bytes; at most 256"));
  }
  // The name reaches operators' terminals (dosctl sessions) and the log:
  // no control characters (an escape sequence would drive the terminal).
  for (size_t i = 0; i < req.client_name().size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(req.client_name()[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attach: client_name has control character 0x", absl::Hex(c, absl::kZeroPad2),
          " at byte ", i, "; use printable characters"));
    }
  }
  if (req.rank() < -1 || (req.world_size() > 0 && req.rank() >= req.world_size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attach: rank ", req.rank(), " is invalid for world_size ", req.world_size(),
        "; send -1 when not distributed, else 0 <= rank < world_size"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<SessionIdentity> DosService::AttachIdentity(
    const RpcCall& call, const v1::AttachRequest& req,
    std::shared_ptr<const PeerProcess> process) const {
  const CallerIdentity& caller = call.caller();
  SessionIdentity id;
  id.client_name = req.client_name();
  id.pid = process != nullptr ? process->pid() : req.pid();
  // The owner: the uid of the gRPC connection and of the descriptor socket's
  // Hello, which must agree (a ticket is no use to another user).
  id.uid = caller.known ? caller.uid : ::geteuid();
  if (process != nullptr) {
    if (caller.known && process->uid() != caller.uid) {
      return absl::PermissionDeniedError(absl::StrCat(
          "attach: the descriptor ticket belongs to uid ", process->uid(), " but uid ",
          caller.uid, " called; a process attaches only with its own ticket"));
    }
    id.uid = process->uid();
  }
  id.process = std::move(process);
  id.rank = req.rank();
  id.local_rank = req.local_rank();
  id.world_size = req.world_size();
  return id;
}

absl::Status DosService::HandleAttach(const RpcCall& call, const v1::AttachRequest& req,
                                      v1::AttachResponse* resp) {
  if (req.protocol_version() != kProtocolVersion) {
    return VersionMismatch(req.client_version(), req.protocol_version(), version_);
  }
  if (req.pid() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach: pid ", req.pid(), " is invalid; send the trainer's getpid()"));
  }
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<const PeerProcess> process, AttachingProcess(call, req));
  DOS_RETURN_IF_ERROR(CheckAttachNameAndRank(req));
  DOS_ASSIGN_OR_RETURN(SessionIdentity id, AttachIdentity(call, req, std::move(process)));
  if (req.has_resume() && req.resume().session_id() != 0 && req.resume().token().empty()) {
    return absl::InvalidArgumentError(
        "attach: resume.token is empty; pass the token the first Attach returned");
  }
  bool resumed = false;
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       sessions_->Attach(std::move(id), req.resume().session_id(),
                                         req.resume().token(), &resumed));
  resp->set_resumed(resumed);
  resp->mutable_session()->set_session_id(s->identity().id);
  resp->mutable_session()->set_token(s->identity().token);
  resp->set_control_block_bytes(s->control_block_bytes());
  resp->set_daemon_pid(getpid());
  resp->set_daemon_version(version_);
  return absl::OkStatus();
}

absl::Status DosService::HandleDetach(const RpcCall& call, const v1::DetachRequest& req,
                                      v1::DetachResponse*) {
  if (req.session().session_id() == 0) {
    return absl::InvalidArgumentError(
        "detach: session.session_id is 0; pass the id Attach returned");
  }
  DOS_RETURN_IF_ERROR(call.MayActOn(FindSession(*sessions_, req.session()), "detach").status());
  return sessions_->Detach(req.session().session_id(), req.session().token());
}

absl::Status DosService::HandleRegisterShard(const RpcCall& call,
                                             const v1::RegisterShardRequest& req,
                                             v1::RegisterShardResponse* resp) {
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       call.MayActOn(FindSession(*sessions_, req.session()), "register"));
  DOS_RETURN_IF_ERROR(s->BeginRegister());  // before the request is copied
  absl::Cleanup registered = [&s] { s->EndRegister(); };
  DOS_RETURN_IF_ERROR(AdmitRegistration(*s, req));
  absl::StatusOr<ShardSpec> spec = ToShardSpec(req);
  absl::Status st = spec.ok() ? s->Register(*spec) : spec.status();
  if (!st.ok()) {
    st = WithOrphansHolding(*sessions_, s->identity().uid, std::move(st));
    // The trainer gets the reason; the operator reads it here.
    const SessionIdentity& id = s->identity();
    DOS_LOG_WARNING("session.register_refused", "session", id.id, "client", id.client_name,
                    "uid", id.uid, "pid", id.pid, "rank", id.rank, "code",
                    absl::StatusCodeToString(st.code()), "error", st.message());
    return st;
  }
  Session::Summary sum = s->summary();
  resp->set_total_params(sum.params);
  resp->set_num_subgroups(sum.subgroups);
  resp->set_host_state_bytes(sum.state_bytes);
  resp->set_state_format(static_cast<v1::StateFormat>(sum.state_format));
  resp->set_step(sum.step);
  resp->set_restored_from(sum.restored_from);
  for (const auto& [first, last] : sum.tensor_subgroups) {
    resp->add_tensor_first_subgroup(first);
    resp->add_tensor_last_subgroup(last);
  }
  return absl::OkStatus();
}

absl::Status DosService::HandleGetPolicy(const RpcCall&, const v1::GetPolicyRequest& req,
                                         v1::GetPolicyResponse* resp) {
  if (req.session().session_id() == 0) {
    resp->set_policy(FormatPolicy(sessions_->default_policy()));
    return absl::OkStatus();
  }
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       FindSessionOrOperator(*sessions_, req.session()));
  resp->set_policy(FormatPolicy(s->policy()));
  return absl::OkStatus();
}

absl::Status DosService::HandleSetPolicy(const RpcCall& call, const v1::SetPolicyRequest& req,
                                         v1::SetPolicyResponse* resp) {
  DOS_ASSIGN_OR_RETURN(Policy policy, ParsePolicy(req.policy()));
  if (req.session().session_id() == 0) {
    DOS_RETURN_IF_ERROR(call.MustBeOperator("set the default policy"));
    sessions_->SetDefaultPolicy(policy);
    DOS_LOG_INFO("policy.default", "policy", FormatPolicy(policy));
  } else {
    DOS_ASSIGN_OR_RETURN(
        std::shared_ptr<Session> s,
        call.MayActOn(FindSessionOrOperator(*sessions_, req.session()), "set policy"));
    s->SetPolicy(policy);
    DOS_LOG_INFO("policy.set", "session", req.session().session_id(), "policy",
                 FormatPolicy(policy));
  }
  resp->set_policy(FormatPolicy(policy));
  return absl::OkStatus();
}

absl::Status DosService::HandleGetStats(const RpcCall&, const v1::GetStatsRequest& req,
                                        v1::GetStatsResponse* resp) {
  if (req.session_id() != 0) {
    DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_->FindUnchecked(req.session_id()));
    FillSessionStats(*s, resp->add_sessions());
  } else {
    for (const auto& s : sessions_->List()) FillSessionStats(*s, resp->add_sessions());
  }
  const HostMemoryBudget::Viewed viewed = budget_->viewed();  // as of the last reap (1 s)
  resp->set_host_state_bytes(budget_->used());
  resp->set_host_state_viewed_bytes(viewed.bytes);
  resp->set_host_state_viewed_shards(static_cast<uint32_t>(viewed.shards));
  resp->set_host_state_limit_bytes(budget_->limit());
  resp->set_uptime_s(absl::ToDoubleSeconds(absl::Now() - started_));
  FillUidUsage(*sessions_, resp);
  const std::vector<std::shared_ptr<Session>> live = sessions_->List();
  const ExecutorSet& executors = *sessions_->executors();
  const NodeResources::View node = executors.node().Snapshot();
  for (size_t i = 0; i < executors.devices().size(); ++i) {
    const GpuDeviceInfo& d = executors.devices()[i];
    v1::GpuEngineInfo* e = resp->add_gpu_engines();
    e->set_ordinal(d.ordinal);
    e->set_uuid(d.uuid);
    e->set_name(d.name);
    uint32_t n = 0;
    for (const auto& s : live) n += s->summary().gpu_device == d.ordinal ? 1 : 0;
    e->set_sessions(n);
    if (i < node.engines.size()) {
      const NodeResources::EngineView& v = node.engines[i];
      e->set_active(v.active);
      e->set_host_share(v.share);
      e->set_params(v.params);
      e->set_host_params(v.host_params);
      e->set_planned_share(v.planned_share);
      e->set_predicted_us(v.predicted_us);
      e->set_measured_us(v.measured_us);
      e->set_binding(v.binding);
      e->set_host_alone_gbps(v.host_alone_bytes_per_s * 1e-9);
    }
  }
  if (executors.has_gpu()) {
    v1::NodeModel* m = resp->mutable_node();
    m->set_active_engines(node.active);
    m->set_host_gbps(node.host_bytes_per_s * 1e-9);
    m->set_cpu_gparams_per_s(node.cpu_params_per_s * 1e-9);
    m->set_bound_gparams_per_s(node.bound_params_per_s * 1e-9);
  }
  FillCheckpointUsage(resp);
  return absl::OkStatus();
}

absl::Status DosService::HandleListSessions(const RpcCall&, const v1::ListSessionsRequest&,
                                            v1::ListSessionsResponse* resp) {
  const std::vector<std::shared_ptr<Session>> live = sessions_->List();
  std::vector<std::shared_ptr<Session>> all = live;
  for (auto& o : sessions_->ListOrphans()) all.push_back(std::move(o));
  for (size_t i = 0; i < all.size(); ++i) {
    const std::shared_ptr<Session>& s = all[i];
    const SessionIdentity& id = s->identity();
    Session::Summary sum = s->summary();
    v1::SessionInfo* info = resp->add_sessions();
    info->set_session_id(id.id);
    info->set_client_name(id.client_name);
    info->set_pid(id.pid);
    info->set_rank(id.rank);
    info->set_local_rank(id.local_rank);
    info->set_world_size(id.world_size);
    // "orphaned": its trainer died; the state waits --session_lease for a resume.
    const RegisterProgress::View reg = s->register_progress();
    info->set_state(i >= live.size()            ? "orphaned"
                    : sum.registered              ? "registered"
                    : reg.phase != kRegisterIdle ? "registering"
                                                  : "attached");
    if (reg.phase != kRegisterIdle) {
      v1::RegisterProgress* p = info->mutable_register_progress();
      p->set_phase(RegisterPhaseName(reg.phase));
      p->set_bytes_done(reg.bytes_done);
      p->set_bytes_total(reg.bytes_total);
      p->set_phase_seconds(reg.phase_seconds);
      p->set_total_seconds(reg.total_seconds);
    }
    info->set_params(sum.params);
    info->set_num_tensors(sum.tensors);
    info->set_num_subgroups(sum.subgroups);
    info->set_host_state_bytes(sum.state_bytes);
    info->set_state_format(static_cast<v1::StateFormat>(sum.state_format));
    info->set_policy(FormatPolicy(s->policy()));
    info->set_steps(s->stats().steps);
    info->set_device(DeviceName(sum));
    info->set_device_uuid(sum.gpu_uuid);
  }
  resp->set_daemon_pid(getpid());
  resp->set_daemon_version(version_);
  resp->set_protocol_version(kProtocolVersion);
  return absl::OkStatus();
}

namespace {
// The session a state transfer names, after checking the request's buffer.
// Who may touch the session is checked before anything about the request.
absl::Status CheckTransferBuffer(const v1::TransferStateRequest& req) {
  absl::StatusOr<MemoryRef> ref = ToSegmentRef(req.buffer(), "state transfer: buffer");
  return ref.ok() ? absl::OkStatus() : ref.status();
}
}  // namespace

absl::Status DosService::HandleExportState(const RpcCall& call,
                                           const v1::TransferStateRequest& req,
                                           v1::TransferStateResponse* resp) {
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       call.MayActOn(FindSession(*sessions_, req.session()), "export state"));
  DOS_RETURN_IF_ERROR(CheckTransferBuffer(req));
  DOS_ASSIGN_OR_RETURN(int64_t step,
                       s->ExportState(req.tensor(), req.offset(), req.count(),
                                      SegmentRef(req.buffer().segment(), req.buffer().offset())));
  resp->set_step(step);
  return absl::OkStatus();
}

absl::Status DosService::HandleImportState(const RpcCall& call,
                                           const v1::TransferStateRequest& req,
                                           v1::TransferStateResponse* resp) {
  DOS_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       call.MayActOn(FindSession(*sessions_, req.session()), "import state"));
  DOS_RETURN_IF_ERROR(CheckTransferBuffer(req));
  if (req.step() < 0 || req.step() > kMaxImportedStep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "import state: step ", req.step(), " is out of range; a step count is in [0, ",
        kMaxImportedStep, "] (the next step must not overflow)"));
  }
  DOS_RETURN_IF_ERROR(s->ImportState(req.tensor(), req.offset(), req.count(),
                                     SegmentRef(req.buffer().segment(), req.buffer().offset()),
                                     req.step()));
  resp->set_step(req.step());
  return absl::OkStatus();
}

}  // namespace dos
