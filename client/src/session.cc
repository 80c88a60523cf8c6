// ClientSession: attach and detach, buffers, registration and the policy;
// steps are in session_step.cc, state transfer in session_state.cc.
#include "session.h"

#include "oom_score.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "request_builder.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/socket_access.h"
#include "dos/wire/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace dos::client {
ClientSession::ClientSession(Options options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Dos::NewStub(channel_)) {}

ClientSession::~ClientSession() {
  if (watchdog_.joinable()) {
    {
      absl::MutexLock lock(&watchdog_mu_);
      watchdog_stop_ = true;
    }
    watchdog_.join();
  }
  if (attached_) Detach().IgnoreError();
  if (device_sync_ != nullptr && step_channel_ != nullptr && device_sync_->waits_queued()) {
    // The trainer's streams may still hold waits on the progress words that
    // the GPU has not reached (a per-layer wait queued behind other work).
    // Release them all and let the device pass them before device_sync_
    // unregisters the block and control_segment_ unmaps it.
    //
    // The release value is seq_, the last step published: every wait was
    // queued for a step <= seq_. Not UINT32_MAX: cuStreamWaitValue32's GEQ
    // compares cyclically ((int32_t)(*word - value) >= 0), so UINT32_MAX is
    // *below* every small seq and turned each pending wait into one that
    // never passes, and the synchronisation below into a hang whenever the
    // GPU had not evaluated a wait yet when the word was overwritten.
    step_channel_->MarkAllDone(seq_, num_subgroups_);
    if (!device_sync_->Drain(kDrainTimeout)) {
      // The device did not get past the waits in time: leave the block
      // registered and mapped (a bounded leak at teardown) rather than block
      // this thread or let the GPU read a vanished mapping.
      std::fprintf(stderr,
                   "libdos_client: session %llu: the GPU did not finish its queued work within "
                   "%s of closing the session; its control block stays mapped\n",
                   static_cast<unsigned long long>(id()),
                   absl::FormatDuration(kDrainTimeout).c_str());
      (void)device_sync_.release();
      (void)control_segment_.release();
    }
  }
}

void ClientSession::WatchSteps() {
  absl::MutexLock lock(&watchdog_mu_);
  for (;;) {
    // Wakes on stop or every slice.
    watchdog_mu_.AwaitWithTimeout(absl::Condition(&watchdog_stop_),
                                  ControlBlockChannel::kLivenessSlice);
    if (watchdog_stop_) return;
    uint32_t seq = inflight_seq_.load(std::memory_order_acquire);
    if (seq == 0 || control_->done_bell.load(std::memory_order_acquire) == seq) continue;
    if (control_->closed.load(std::memory_order_acquire) != 0 ||
        !step_channel_->DaemonAlive()) {
      abandoned_.store(true, std::memory_order_release);
      step_channel_->MarkAllDone(seq, num_subgroups_);
      inflight_seq_.compare_exchange_strong(seq, 0);
    }
  }
}

void ClientSession::PrepareContext(grpc::ClientContext* context, absl::Duration extra) const {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout + extra));
}

absl::Status ClientSession::FromRpc(const char* call, const grpc::Status& status) const {
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (code == absl::StatusCode::kUnavailable) {
    return absl::UnavailableError(absl::StrCat(
        call, ": dosd is not reachable at unix:", options_.socket_path, " (",
        status.error_message(),
        "); start the daemon (systemctl start dosd, or dosd --socket=", options_.socket_path,
        ") or point DOS_SOCKET / socket_path at a running one"));
  }
  // dosd's messages already name the call ("register: ..."): not twice.
  if (absl::StartsWith(status.error_message(), absl::StrCat(call, ":"))) {
    return absl::Status(code, status.error_message());
  }
  return absl::Status(code, absl::StrCat(call, ": ", status.error_message()));
}


absl::StatusOr<std::unique_ptr<ClientSession>> ClientSession::Attach(const Options& options) {
  if (absl::Status st = CheckDaemonSocket(options.socket_path); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("attach: ", st.message()));
  }
  auto channel =
      grpc::CreateChannel(absl::StrCat("unix:", options.socket_path),
                          grpc::InsecureChannelCredentials());
  std::unique_ptr<ClientSession> s(new ClientSession(options, std::move(channel)));

  v1::AttachRequest req;
  req.set_client_name(options.client_name);
  req.set_pid(static_cast<int32_t>(::getpid()));
  req.set_rank(options.rank);
  req.set_local_rank(options.local_rank);
  req.set_world_size(options.world_size);
  req.set_protocol_version(kProtocolVersion);
  req.set_client_version(DOS_CLIENT_RELEASE);
  // Test hook (tests/integration/versions_test.cc): claim another protocol
  // or release, as an older or newer client would.
  if (const char* v = std::getenv("DOS_TEST_CLAIM_PROTOCOL_VERSION"); v != nullptr && *v) {
    req.set_protocol_version(static_cast<uint32_t>(std::strtoul(v, nullptr, 10)));
  }
  if (const char* v = std::getenv("DOS_TEST_CLAIM_CLIENT_VERSION"); v != nullptr) {
    req.set_client_version(v);
  }
  // The kernel tells dosd who we are on its descriptor socket (whatever our
  // pid namespace); the ticket it answers makes the session ours.
  s->fd_socket_ = fdproto::SocketPathFor(options.socket_path);
  {
    absl::StatusOr<std::string> ticket = fdproto::Hello(s->fd_socket_, options.rpc_timeout);
    if (!ticket.ok()) {
      return absl::Status(ticket.status().code(),
                          absl::StrCat("attach: ", ticket.status().message()));
    }
    req.set_fd_ticket(*ticket);
  }
  if (options.resume_session_id != 0) {
    req.mutable_resume()->set_session_id(options.resume_session_id);
    req.mutable_resume()->set_token(options.resume_token);
  }
  v1::AttachResponse resp;
  grpc::ClientContext ctx;
  s->PrepareContext(&ctx);
  grpc::Status rpc = s->stub_->Attach(&ctx, req, &resp);
  if (!rpc.ok()) return s->FromRpc("attach", rpc);
  s->ref_ = resp.session();
  s->resumed_ = resp.resumed();
  s->attached_ = true;  // from here on the destructor detaches

  absl::StatusOr<fdproto::ControlBlockHandle> cb =
      fdproto::FetchControlBlock(s->fd_socket_, s->id(), s->token(), options.rpc_timeout);
  if (!cb.ok()) {
    return absl::Status(cb.status().code(),
                        absl::StrCat("attach: control block: ", cb.status().message()));
  }
  DOS_ASSIGN_OR_RETURN(s->control_segment_, ShmSegment::Adopt(std::move(cb->memfd),
                                                              "control block"));
  s->daemon_connection_ = std::move(cb->connection);
  s->control_ = static_cast<ControlBlock*>(s->control_segment_->data());
  if (absl::Status st = ControlBlockChannel::Validate(s->control_, s->control_segment_->size());
      !st.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("attach: control block: ", st.message(),
                     "; upgrade the client or the daemon so they match"));
  }
  s->step_channel_ = std::make_unique<ControlBlockChannel>(s->control_);
  s->step_channel_->SetDaemonConnection(s->daemon_connection_.get());
  s->control_->client_pid = static_cast<int32_t>(::getpid());
  RaiseOomScore(s->control_->daemon_pid);  // out of memory, a trainer dies before dosd
  return s;
}

RegisterProgressView ClientSession::register_progress() const {
  RegisterProgressView v;
  const RegisterProgressWords& w = control_->register_progress;
  v.phase = w.phase.load(std::memory_order_acquire);
  v.phase_name = RegisterPhaseName(v.phase);
  if (v.phase == kRegisterIdle) return v;
  v.bytes_done = w.bytes_done.load(std::memory_order_relaxed);
  v.bytes_total = w.bytes_total.load(std::memory_order_relaxed);
  // Both processes read CLOCK_MONOTONIC, one clock per host.
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  const uint64_t now =
      static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
  const uint64_t phase_start = w.phase_start_ns.load(std::memory_order_relaxed);
  const uint64_t start = w.start_ns.load(std::memory_order_relaxed);
  v.phase_seconds = now > phase_start ? (now - phase_start) * 1e-9 : 0;
  v.total_seconds = now > start ? (now - start) * 1e-9 : 0;
  return v;
}

absl::Status ClientSession::Detach() {
  if (!attached_) return absl::OkStatus();
  attached_ = false;
  if (control_ != nullptr &&
      (control_->closed.load(std::memory_order_acquire) != 0 ||
       step_channel_ == nullptr || !step_channel_->DaemonAlive())) {
    // dosd already closed the session (it stopped or dropped us) or is gone:
    // nothing to detach. No RPC either: a channel to a dead socket would start
    // reconnecting, and a process exiting right after must not have gRPC
    // threads busy while its static destructors run.
    return absl::OkStatus();
  }
  v1::DetachRequest req;
  *req.mutable_session() = ref_;
  v1::DetachResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  grpc::Status rpc = stub_->Detach(&ctx, req, &resp);
  if (!rpc.ok()) return FromRpc("detach", rpc);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ClientSession::CreateSegment(uint64_t bytes,
                                                                         bool transfer) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t rounded = (std::max<uint64_t>(bytes, 1) + page - 1) / page * page;
  // A label, not a name: it shows in /proc/<pid>/fd as "/memfd:<label>".
  const std::string label =
      absl::StrCat("dos.", id(), transfer ? ".x" : ".", next_segment_++);
  return ShmSegment::Create(label, rounded);
}

absl::StatusOr<std::vector<uint64_t>> ClientSession::SendSegments(
    const std::vector<const ShmSegment*>& segs) {
  std::vector<int> fds;
  for (const ShmSegment* s : segs) fds.push_back(s->fd());
  return fdproto::SendSegments(fd_socket_, id(), token(), fds, options_.rpc_timeout);
}

absl::StatusOr<void*> ClientSession::AllocBuffer(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("buffer_alloc: 0 bytes requested");
  DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(bytes, /*transfer=*/false));
  void* data = seg->data();
  table_.Add(seg->label(), data, seg->size());
  buffers_.push_back(std::move(seg));
  return data;
}

absl::Status ClientSession::SetStateFormat(int format) {
  if (registered_) {
    return absl::FailedPreconditionError(
        "set_state_format: the session already registered its tensors; choose the state format "
        "before dos_register");
  }
  if (format != DOS_STATE_FP32 && format != DOS_STATE_COMPACT) {
    return absl::InvalidArgumentError(absl::StrCat(
        "set_state_format: ", format, " is not a state format; use DOS_STATE_FP32 (0) or "
        "DOS_STATE_COMPACT (1)"));
  }
  state_format_ = format;
  return absl::OkStatus();
}

absl::Status ClientSession::Register(absl::Span<const dos_tensor> tensors,
                                     absl::Span<const dos_hparams> groups,
                                     uint64_t subgroup_size) {
  if (registered_) {
    return absl::FailedPreconditionError(
        "register: this session already registered its tensors; register once per session "
        "(attach a new session for a different set)");
  }
  DOS_ASSIGN_OR_RETURN(v1::RegisterShardRequest req,
                       BuildRegisterRequest(tensors, groups, subgroup_size, table_, &device_));
  *req.mutable_session() = ref_;
  req.set_state_format(static_cast<v1::StateFormat>(state_format_));
  // The buffers the tensors lie in go to dosd by descriptor; the request
  // names them by the ids it answers.
  {
    std::map<std::string, const ShmSegment*> used;
    for (const auto& b : buffers_) {
      for (const v1::TensorSpec& t : req.tensors()) {
        for (const v1::MemoryLocation* loc : {&t.param(), &t.grad()}) {
          if (loc->has_shm() && loc->shm().name() == b->label()) used[b->label()] = b.get();
        }
      }
    }
    std::vector<const ShmSegment*> segs;
    for (const auto& [label, seg] : used) segs.push_back(seg);
    std::map<std::string, uint64_t> ids;
    if (!segs.empty()) {
      absl::StatusOr<std::vector<uint64_t>> sent = SendSegments(segs);
      if (!sent.ok()) {
        return absl::Status(sent.status().code(),
                            absl::StrCat("register: ", sent.status().message()));
      }
      for (size_t i = 0; i < segs.size(); ++i) ids[segs[i]->label()] = (*sent)[i];
    }
    for (v1::TensorSpec& t : *req.mutable_tensors()) {
      for (v1::MemoryLocation* loc : {t.mutable_param(), t.mutable_grad()}) {
        if (!loc->has_shm()) continue;
        loc->mutable_shm()->set_segment(ids[loc->shm().name()]);
        loc->mutable_shm()->clear_name();
      }
    }
  }
  // GPU mode: stream-ordered step synchronisation where the driver has it;
  // otherwise the caller synchronises and waits on the host.
  std::unique_ptr<DeviceSync> device_sync;
  if (!tensors.empty() && req.tensors(0).param().has_cuda_ipc()) {
    absl::StatusOr<std::unique_ptr<DeviceSync>> ds =
        DeviceSync::Create(tensors[0].param, control_, sizeof(ControlBlock));
    if (ds.ok()) {
      device_sync = std::move(*ds);
      req.set_cuda_ipc_event(device_sync->event_handle());
    } else if (!absl::IsUnimplemented(ds.status())) {
      return ds.status();
    }
  }
  v1::RegisterShardResponse resp;
  grpc::ClientContext ctx;
  // The daemon allocates, page-locks and fills 12 (or 8) bytes of state per
  // parameter before it answers (a 6B-parameter shard: 72 GB): allow for
  // that beyond the control-plane timeout.
  uint64_t total_numel = 0;
  for (const dos_tensor& t : tensors) total_numel += t.numel;
  PrepareContext(&ctx, absl::Seconds(3.0 * static_cast<double>(total_numel) * 12 / (1 << 30)));
  grpc::Status rpc = stub_->RegisterShard(&ctx, req, &resp);
  if (!rpc.ok()) return FromRpc("register", rpc);
  device_sync_ = std::move(device_sync);
  tensor_subgroups_.clear();
  for (int i = 0; i < resp.tensor_first_subgroup_size() && i < resp.tensor_last_subgroup_size();
       ++i) {
    tensor_subgroups_.emplace_back(resp.tensor_first_subgroup(i), resp.tensor_last_subgroup(i));
  }
  num_subgroups_ = resp.num_subgroups();
  registered_ = true;
  num_groups_ = groups.size();
  tensors_.clear();
  for (size_t i = 0; i < tensors.size(); ++i) tensors_.push_back(DescribeTensor(tensors[i], i));
  return absl::OkStatus();
}


absl::Status ClientSession::SetPolicy(const std::string& policy) {
  v1::SetPolicyRequest req;
  *req.mutable_session() = ref_;
  req.set_policy(policy);
  v1::SetPolicyResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  grpc::Status rpc = stub_->SetPolicy(&ctx, req, &resp);
  if (!rpc.ok()) return FromRpc("set_policy", rpc);
  return absl::OkStatus();
}

}  // namespace dos::client
