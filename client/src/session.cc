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

absl::Status ClientSession::StepBeginOnStream(const dos_step_args& args, void* stream) {
  if (device_sync_ == nullptr) {
    return absl::FailedPreconditionError(
        "step_begin_on_stream: this session has no stream synchronisation (its tensors are in "
        "shared memory, or the CUDA driver lacks stream memory operations); synchronise the "
        "stream and call dos_step_begin");
  }
  if (!registered_ || step_in_flight_) return StepBegin(args);  // their errors
  DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
  return StepBegin(args, kStepTrainerEventRecorded);
}

absl::Status ClientSession::WaitSubgroups(uint32_t first, uint32_t last, void* stream,
                                          absl::Duration timeout) {
  if (!registered_) {
    return absl::FailedPreconditionError(
        "wait_subgroups: no tensors registered; call dos_register first");
  }
  if (first > last || last >= num_subgroups_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "wait_subgroups: range [", first, ", ", last, "] is not within the session's ",
        num_subgroups_, " subgroups (dos_tensor_subgroups gives a tensor's range)"));
  }
  if (!step_in_flight_) return absl::OkStatus();  // the last step's result was taken
  if (stream != nullptr && device_sync_ != nullptr) {
    // One wait per word; subgroups from kMaxTrackedSubgroups - 1 on share one.
    const uint32_t end = std::min(last, kMaxTrackedSubgroups - 1);
    for (uint32_t i = first; i <= end; ++i) {
      DOS_RETURN_IF_ERROR(device_sync_->StreamWait(stream, step_channel_->DoneWord(i), seq_));
    }
    return absl::OkStatus();
  }
  absl::Status st = step_channel_->WaitSubgroups(first, last, seq_, timeout);
  if (st.ok() && abandoned_.load(std::memory_order_acquire)) {
    return absl::UnavailableError(absl::StrCat(
        "wait_subgroups: step ", seq_, " was abandoned: dosd (pid ", control_->daemon_pid,
        ") closed the session or is gone; restart it and attach again"));
  }
  return st;
}

absl::Status ClientSession::TensorSubgroups(uint32_t tensor, uint32_t* first,
                                            uint32_t* last) const {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "tensor_subgroups"));
  if (tensor >= tensor_subgroups_.size()) {
    return absl::FailedPreconditionError(
        "tensor_subgroups: the daemon did not report its layout (an older dosd)");
  }
  *first = tensor_subgroups_[tensor].first;
  *last = tensor_subgroups_[tensor].second;
  return absl::OkStatus();
}

absl::Status ClientSession::StepBegin(const dos_step_args& args, uint32_t extra_flags) {
  if (!registered_) {
    return absl::FailedPreconditionError("step: no tensors registered; call dos_register first");
  }
  if (step_in_flight_) {
    return absl::FailedPreconditionError(
        "step: a step is already in flight; call dos_step_wait before beginning another");
  }
  if (control_->closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError("step: the daemon closed this session (shutdown or detach)");
  }
  StepRequest& r = control_->request;
  DOS_RETURN_IF_ERROR(FillStepRequest(args, num_groups_, tensors_.size(), &r));
  r.flags |= extra_flags;
  bool lease_lowered = false;
  if (lease_set_) {
    r.flags |= kStepGpuLease;
    r.gpu_lease_bytes = lease_.lease_bytes;
    r.gpu_budget_bytes = lease_.budget_bytes;
    r.gpu_peak_bytes = lease_.peak_bytes;
    lease_lowered = !lease_sent_ || lease_.lease_bytes < lease_sent_bytes_;
    lease_sent_ = true;
    lease_sent_bytes_ = lease_.lease_bytes;
  }
  r.seq = control_->request_bell.load(std::memory_order_relaxed) + 1;
  seq_ = step_channel_->PublishRequest();
  step_in_flight_ = true;
  inflight_seq_.store(seq_, std::memory_order_release);
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { WatchSteps(); });
  if (lease_lowered) {
    // dosd gives the memory back before this step's update; the trainer may
    // allocate it as soon as we return. A daemon that closed the session or
    // died is reported by StepWait, as for any step.
    absl::Status applied = step_channel_->WaitLeaseApplied(seq_, absl::InfiniteDuration());
    if (!applied.ok()) lease_sent_ = false;  // tell the next step's dosd again
  }
  return absl::OkStatus();
}

absl::Status ClientSession::StepBeginEarly(const dos_step_args& args, uint32_t flags,
                                           void* stream) {
  if (flags & ~static_cast<uint32_t>(DOS_EARLY_NO_VERDICT)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_begin_early: unknown flags ", flags, "; pass 0 or DOS_EARLY_NO_VERDICT"));
  }
  if (!registered_ || step_in_flight_) return StepBegin(args);  // their errors
  const bool no_verdict = (flags & DOS_EARLY_NO_VERDICT) != 0;
  uint32_t extra = kStepGradientsPending;
  if (no_verdict) extra |= kStepNoVerdict | kStepGradientsChecked;
  if (device_sync_ != nullptr) {
    // Orders the daemon's streams after what the trainer queued so far (the
    // last step's zero_grad, this backward's beginning); each subgroup's
    // gradients are then announced by its ready word.
    DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
    extra |= kStepTrainerEventRecorded;
  }
  ready_marked_.assign(num_subgroups_, 0);
  tail_unmarked_ = num_subgroups_ >= kMaxTrackedSubgroups ? num_subgroups_ - (kMaxTrackedSubgroups - 1)
                                                          : 0;
  DOS_RETURN_IF_ERROR(StepBegin(args, extra));
  early_ = true;
  early_no_verdict_ = no_verdict;
  verdict_sent_ = false;
  return absl::OkStatus();
}

absl::Status ClientSession::MarkOne(uint32_t i, void* stream) {
  if (ready_marked_[i]) return absl::OkStatus();
  ready_marked_[i] = 1;
  if (i >= kMaxTrackedSubgroups - 1 && --tail_unmarked_ != 0) return absl::OkStatus();
  // GPU mode: stream-ordered; dosd cannot be woken by the stream's write and
  // polls the word with a bounded backoff. Otherwise a store that wakes it.
  if (device_sync_ != nullptr) {
    return device_sync_->StreamWrite(stream, step_channel_->ReadyWord(i), seq_);
  }
  step_channel_->MarkReady(i, seq_);
  return absl::OkStatus();
}

absl::Status ClientSession::MarkReady(uint32_t first, uint32_t last, void* stream) {
  if (!early_ || !step_in_flight_ || verdict_sent_) {
    return absl::FailedPreconditionError(
        "mark_ready: no early step awaits gradients; begin one with dos_step_begin_early");
  }
  if (first > last || last >= num_subgroups_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mark_ready: range [", first, ", ", last, "] is not within the session's ",
        num_subgroups_, " subgroups (dos_tensor_subgroups gives a tensor's range)"));
  }
  for (uint32_t i = first; i <= last; ++i) DOS_RETURN_IF_ERROR(MarkOne(i, stream));
  return absl::OkStatus();
}

absl::Status ClientSession::StepVerdict(const dos_step_args* args, void* stream) {
  if (!early_ || !step_in_flight_ || verdict_sent_) {
    return absl::FailedPreconditionError(
        "step_verdict: no early step awaits its verdict; begin one with dos_step_begin_early");
  }
  if (args == nullptr && early_no_verdict_) {
    return absl::FailedPreconditionError(
        "step_abandon: an early step without a verdict (DOS_EARLY_NO_VERDICT) cannot be "
        "abandoned: dosd applies its subgroups as they become ready; call dos_step_verdict");
  }
  if (early_no_verdict_) {
    // Tensors without a gradient (their subgroups were never announced, so
    // dosd has not updated them): published before those subgroups are
    // announced, so dosd reads the mask before it updates them.
    StepRequest late{};
    DOS_RETURN_IF_ERROR(FillSkipMask(*args, tensors_.size(), &late));
    if (late.flags != 0) {
      StepRequest& v = control_->verdict;
      v = late;
      v.seq = seq_;
      step_channel_->PublishVerdict(seq_);
    }
  }
  // Every subgroup not announced yet is final now (unused parameters, a
  // gradient replaced outside autograd's hooks): announced after the work
  // queued so far.
  for (uint32_t i = 0; i < num_subgroups_; ++i) DOS_RETURN_IF_ERROR(MarkOne(i, stream));
  if (!early_no_verdict_) {
    StepRequest& v = control_->verdict;
    if (args == nullptr) {
      v = StepRequest{};
      v.flags = kStepAbandon;
    } else {
      DOS_RETURN_IF_ERROR(FillStepRequest(*args, num_groups_, tensors_.size(), &v));
      if (device_sync_ != nullptr) {
        // Whatever the trainer did to the gradients after backward (an
        // in-place clip, a copy into the registered buffer) comes before
        // dosd reads them.
        DOS_RETURN_IF_ERROR(device_sync_->RecordGradientsReady(stream));
        v.flags |= kStepTrainerEventRecorded;
      }
    }
    v.seq = seq_;
    step_channel_->PublishVerdict(seq_);
  }
  verdict_sent_ = true;
  return absl::OkStatus();
}

absl::Status ClientSession::StepWait(absl::Duration timeout, dos_step_result* result) {
  if (!step_in_flight_) {
    return absl::FailedPreconditionError("step_wait: no step in flight; call dos_step_begin");
  }
  if (early_ && !verdict_sent_) {
    return absl::FailedPreconditionError(
        "step_wait: the early step in flight has no verdict yet (dosd waits for it); call "
        "dos_step_verdict or dos_step_abandon first");
  }
  absl::Status waited = step_channel_->WaitResult(seq_, timeout);
  if (!absl::IsDeadlineExceeded(waited)) inflight_seq_.store(0, std::memory_order_release);
  if (absl::IsDeadlineExceeded(waited)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "step_wait: step ", seq_, " not finished after ", absl::FormatDuration(timeout),
        "; it is still in flight, call dos_step_wait again"));
  }
  if (!waited.ok()) {
    // The daemon will not finish this step: release anything (the trainer's
    // stream included) still waiting on its subgroups.
    step_channel_->MarkAllDone(seq_, num_subgroups_);
    step_in_flight_ = false;
    early_ = false;
    return absl::Status(waited.code(), absl::StrCat("step_wait: ", waited.message(),
                                                    "; re-attach to continue"));
  }
  step_in_flight_ = false;
  early_ = false;
  const StepResult& res = control_->result;  // published by done_bell (acquire)
  last_early_ = static_cast<int32_t>(res.early);
  last_before_verdict_us_ = res.before_verdict_us;
  last_after_verdict_us_ = res.after_verdict_us;
  last_prefetched_bytes_ = res.prefetched_bytes;
  if (res.seq != seq_) {
    return absl::InternalError(absl::StrCat("step_wait: result seq ", res.seq,
                                            " does not match request seq ", seq_));
  }
  if (res.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(res.status_code),
                        absl::StrCat("step: ", std::string(res.message, strnlen(res.message,
                                                                               kMaxStatusMessage))));
  }
  if (result != nullptr) {
    result->found_inf = res.found_inf != 0;
    result->step = res.step;
    result->wall_us = res.wall_us;
    result->update_us = res.update_us;
  }
  return absl::OkStatus();
}

absl::Status ClientSession::CheckTensor(uint32_t tensor, const char* call) const {
  if (!registered_) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no tensors registered; call dos_register first"));
  }
  if (tensor >= tensors_.size()) {
    return absl::OutOfRangeError(absl::StrCat(call, ": tensor ", tensor, " out of range; ",
                                              tensors_.size(), " tensors are registered"));
  }
  if (step_in_flight_) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": a step is in flight; call dos_step_wait first"));
  }
  return absl::OkStatus();
}

absl::Status ClientSession::ReadState(uint32_t tensor, float* master, float* exp_avg,
                                      float* exp_avg_sq, int64_t* step) {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "state_read"));
  return ReadStateRange(tensor, 0, tensors_[tensor].numel, master, exp_avg, exp_avg_sq, step);
}

absl::Status ClientSession::WriteState(uint32_t tensor, const float* master, const float* exp_avg,
                                       const float* exp_avg_sq, int64_t step) {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "state_write"));
  return WriteStateRange(tensor, 0, tensors_[tensor].numel, master, exp_avg, exp_avg_sq, step);
}

absl::Status ClientSession::CheckRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                       const char* call) const {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, call));
  const uint64_t n = tensors_[tensor].numel;
  if (offset > n || count > n - offset) {
    return absl::OutOfRangeError(absl::StrCat(call, ": elements [", offset, ", ", offset + count,
                                              ") of tensor ", tensor, " are out of range; it has ",
                                              n, " elements"));
  }
  return absl::OkStatus();
}

absl::Status ClientSession::TransferPiece(bool import, uint32_t tensor, uint64_t offset,
                                          uint64_t count, const ShmSegment& seg, int64_t step,
                                          int64_t* step_out) {
  v1::TransferStateRequest req;
  *req.mutable_session() = ref_;
  req.set_tensor(tensor);
  DOS_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, SendSegments({&seg}));
  req.mutable_buffer()->set_segment(ids[0]);
  req.mutable_buffer()->set_offset(0);
  // The whole tensor goes as count 0, which daemons without ranged
  // transfers understand too.
  if (offset != 0 || count != tensors_[tensor].numel) {
    req.set_offset(offset);
    req.set_count(count);
  }
  if (import) req.set_step(step);
  v1::TransferStateResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  grpc::Status rpc = import ? stub_->ImportState(&ctx, req, &resp)
                            : stub_->ExportState(&ctx, req, &resp);
  if (!rpc.ok()) return FromRpc(import ? "state_write" : "state_read", rpc);
  if (step_out != nullptr) *step_out = resp.step();
  return absl::OkStatus();
}

absl::Status ClientSession::ReadStateRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                           float* master, float* exp_avg, float* exp_avg_sq,
                                           int64_t* step) {
  DOS_RETURN_IF_ERROR(CheckRange(tensor, offset, count, "state_read"));
  if (count == 0 || (master == nullptr && exp_avg == nullptr && exp_avg_sq == nullptr)) {
    // Nothing to copy; the step is read with one element.
    if (step == nullptr || tensors_[tensor].numel == 0) return absl::OkStatus();
    DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12, /*transfer=*/true));
    return TransferPiece(false, tensor, 0, 1, *seg, 0, step);
  }
  const uint64_t piece = std::min(count, kStateTransferChunk);
  DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12 * piece, /*transfer=*/true));
  const float* base = static_cast<const float*>(seg->data());
  for (uint64_t done = 0; done < count;) {
    const uint64_t k = std::min(piece, count - done);
    DOS_RETURN_IF_ERROR(TransferPiece(false, tensor, offset + done, k, *seg, 0, step));
    if (master != nullptr) std::memcpy(master + done, base, 4 * k);
    if (exp_avg != nullptr) std::memcpy(exp_avg + done, base + k, 4 * k);
    if (exp_avg_sq != nullptr) std::memcpy(exp_avg_sq + done, base + 2 * k, 4 * k);
    done += k;
  }
  return absl::OkStatus();
}

absl::Status ClientSession::WriteStateRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                            const float* master, const float* exp_avg,
                                            const float* exp_avg_sq, int64_t step) {
  DOS_RETURN_IF_ERROR(CheckRange(tensor, offset, count, "state_write"));
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("state_write: step = ", step, "; must be >= 0"));
  }
  if (count == 0) return absl::OkStatus();
  const uint64_t piece = std::min(count, kStateTransferChunk);
  DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12 * piece, /*transfer=*/true));
  float* base = static_cast<float*>(seg->data());
  const bool partial = master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr;
  uint64_t done = 0;
  while (done < count) {
    const uint64_t k = std::min(piece, count - done);
    if (partial) {  // start from the daemon's current state
      DOS_RETURN_IF_ERROR(TransferPiece(false, tensor, offset + done, k, *seg, 0, nullptr));
    }
    if (master != nullptr) std::memcpy(base, master + done, 4 * k);
    if (exp_avg != nullptr) std::memcpy(base + k, exp_avg + done, 4 * k);
    if (exp_avg_sq != nullptr) std::memcpy(base + 2 * k, exp_avg_sq + done, 4 * k);
    DOS_RETURN_IF_ERROR(TransferPiece(true, tensor, offset + done, k, *seg, step, nullptr));
    done += k;
  }
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
