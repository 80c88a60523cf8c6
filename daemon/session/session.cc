#include "daemon/session/session.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/common/log.h"
#include "daemon/transport/shm_transport.h"
#include "dos/wire/status_macros.h"

namespace dos {

std::atomic<uint64_t> Session::last_state_version_{0};

absl::StatusOr<std::unique_ptr<Session>> Session::Create(
    SessionIdentity identity, const SessionOptions& options, const Policy& policy,
    const ExecutorSet* executors, HostMemoryBudget* budget,
    std::function<void(uint64_t id)> on_client_gone) {
  std::unique_ptr<Session> s(new Session(std::move(identity), options, policy, executors, budget,
                                         std::move(on_client_gone)));
  // A sealed memfd: no name anyone could open or squat; the owner fetches it
  // from the descriptor socket with the session's token.
  DOS_ASSIGN_OR_RETURN(s->control_,
                       ShmSegment::Create(absl::StrCat("dos.ctl.", s->identity_.id),
                                          sizeof(ControlBlock)));
  auto* block = new (s->control_->data()) ControlBlock();
  ControlBlockChannel::InitBlock(block, s->identity_.id, getpid());
  block->client_pid = s->identity_.pid;
  s->channel_ = std::make_unique<ControlBlockChannel>(block);
  s->register_progress_ = std::make_unique<RegisterProgress>(&block->register_progress);
  // The step thread starts at registration: an attached session that never
  // registers costs no thread (SessionManager's reaper checks its client).
  return s;
}

Session::Session(SessionIdentity identity, const SessionOptions& options, const Policy& policy,
                 const ExecutorSet* executors, HostMemoryBudget* budget,
                 std::function<void(uint64_t)> on_client_gone)
    : identity_(std::move(identity)),
      options_(options),
      executors_(executors),
      executor_(executors->host()),
      budget_(budget),
      on_client_gone_(std::move(on_client_gone)),
      policy_(policy) {
  UidLedger* ledger = options.ledger;
  if (ledger == nullptr) {
    own_ledger_ = std::make_unique<UidLedger>(UidLimits{});
    ledger = own_ledger_.get();
  }
  account_ = ledger->OpenAccount(identity_.uid, identity_.id);
}

Session::~Session() {
  Stop();
  {
    OthersLock lock(this);
    CloseTrainerEvent();
  }
  ReleaseControlBlock();
}

absl::StatusOr<UniqueFd> Session::ControlBlockFd() {
  const std::string path = absl::StrCat("/proc/self/fd/", control_->fd());
  absl::MutexLock lock(&block_mu_);
  if (!block_lease_.valid()) block_lease_.reset(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  UniqueFd fd(block_lease_.valid() ? ::open(path.c_str(), O_RDWR | O_CLOEXEC) : -1);
  if (fd.valid()) return fd;
  const int err = errno;
  if (err == EMFILE || err == ENFILE) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "control block of session ", identity_.id, ": dosd is out of descriptors (", path, ": ",
        std::strerror(err), "); raise dosd's descriptor limit (LimitNOFILE)"));
  }
  // No /proc (a sandbox): the memfd itself, as before; its mappings are then
  // not seen after the session (not charged as a closed session's).
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    DOS_LOG_WARNING("session.control_block_untracked", "path", path, "error", std::strerror(err),
                    "fix",
                    "mount /proc in dosd's namespace: without it a closed session's control "
                    "block that a process still maps is not counted against its uid");
  }
  block_lease_.reset();
  UniqueFd dup(::fcntl(control_->fd(), F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("control block of session ", identity_.id, ": cannot duplicate its memfd (",
                     std::strerror(errno), "); raise dosd's descriptor limit (LimitNOFILE)"));
  }
  return dup;
}

void Session::ReleaseControlBlock() {
  // Nothing of dosd's may map the block when its mappings are counted.
  register_progress_.reset();
  channel_.reset();
  control_.reset();
  UniqueFd lease;
  {
    absl::MutexLock lock(&block_mu_);
    lease = std::move(block_lease_);
  }
  if (budget_ == nullptr || !lease.valid()) return;
  // Charged to the uid (not the session), and only to a ledger that
  // outlives the session: it lasts while the block is mapped.
  LedgerCharge charge;
  if (own_ledger_ == nullptr && account_ != nullptr) {
    absl::StatusOr<LedgerCharge> c = account_->ledger()->Charge(
        identity_.uid, UidResource::kClosedBlocks, 1, "closed sessions' control blocks");
    if (c.ok()) charge = *std::move(c);  // kClosedBlocks has no cap of its own
  }
  budget_->HoldBlockWhileMapped(std::move(lease), std::move(charge));
}

void Session::CloseTrainerEvent() {
  if (trainer_event_ != nullptr) engine()->CloseTrainerEvent(trainer_event_);
  trainer_event_ = nullptr;
}

absl::Status Session::StartStepThread() {
  absl::MutexLock lock(&thread_mu_);
  if (stop_.load(std::memory_order_acquire) || step_thread_.joinable()) return absl::OkStatus();
  try {
    step_thread_ = std::thread([this] { StepLoop(); });
  } catch (const std::system_error& e) {
    RequestStop();
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: dosd could not start session ", identity_.id, "'s step thread (", e.what(),
        "); the session is stopped: detach it and attach again, and ask the operator to check "
        "dosd's thread limits (LimitNPROC, TasksMax)"));
  }
  thread_started_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

bool Session::ClientGoneWithoutThread() const {
  return !thread_started_.load(std::memory_order_acquire) && !ClientAlive();
}

void Session::RequestStop() { stop_.store(true, std::memory_order_release); }

void Session::Stop() {
  stop_.store(true, std::memory_order_release);
  const bool first = !stopped_.exchange(true);
  std::thread thread;
  {
    absl::MutexLock lock(&thread_mu_);
    thread = std::move(step_thread_);
  }
  if (thread.joinable()) {
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();
    } else {
      thread.join();
    }
  }
  if (!first) return;
  {
    OthersLock lock(this);
    executor_->ForgetSession(identity_.id);  // its GPU share goes to the others
  }
  if (control_ != nullptr) {
    auto* block = static_cast<ControlBlock*>(control_->data());
    block->closed.store(1, std::memory_order_release);
    // Wake a client blocked on the done bell so it sees `closed`.
    Doorbell(&block->done_bell, &block->client_sleeping)
        .Ring(block->done_bell.load(std::memory_order_relaxed));
    Doorbell(&block->lease_bell, &block->lease_client_sleeping)
        .Ring(block->lease_bell.load(std::memory_order_relaxed));
  }
  absl::MutexLock lock(&conn_mu_);
  client_connections_.clear();  // the client's watchdog sees the hang-up
}

bool Session::TokenMatches(absl::string_view token) const {
  // Constant-time compare: the token is the session's only credential.
  if (token.size() != identity_.token.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < token.size(); ++i) diff |= token[i] ^ identity_.token[i];
  return diff == 0;
}

bool SessionIdentity::ClientAlive() const {
  // The pidfd from the descriptor socket's Hello: exit (zombies included) and
  // pid reuse in any pid namespace. Without one (in-process tests) the pid;
  // Attach refuses pid <= 0.
  if (process != nullptr) return process->Alive();
  return ControlBlockChannel::ProcessAlive(pid);
}

bool Session::ClientAlive() const { return identity_.ClientAlive(); }

void Session::HoldClientConnection(UniqueFd connection) {
  absl::MutexLock lock(&conn_mu_);
  if (stop_.load(std::memory_order_acquire)) return;  // closes it: the session is over
  // A few at most (each fetch of the control block leaves one); the oldest
  // goes first.
  if (client_connections_.size() >= 8) client_connections_.erase(client_connections_.begin());
  client_connections_.push_back(std::move(connection));
}

absl::Status Session::ResolveSegments(ShardSpec* spec) {
  std::map<uint64_t, std::shared_ptr<ShmSegment>> taken;
  for (uint32_t i = 0; i < spec->tensors.size(); ++i) {
    TensorSpec& t = spec->tensors[i];
    for (auto [ref, part] : {std::pair{&t.param, "param"}, std::pair{&t.grad, "grad"}}) {
      if (ref->is_cuda_ipc() || ref->segment_id == 0) continue;  // ShmTransport says why
      auto it = taken.find(ref->segment_id);
      if (it == taken.end()) {
        DOS_ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg,
                             inbox_.Take(ref->segment_id, TensorWhat(i, t.desc.name, part)));
        it = taken.emplace(ref->segment_id, std::move(seg)).first;
      }
      ref->segment = it->second;
    }
  }
  return absl::OkStatus();
}

void Session::StepLoop() {
  std::string thread_name = absl::StrCat("dos-step-", identity_.id).substr(0, 15);
  pthread_setname_np(pthread_self(), thread_name.c_str());
  uint32_t last = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    uint32_t seq = channel_->WaitRequest(last, options_.liveness_interval);
    if (seq == last) {
      if (!ClientAlive()) {
        DOS_LOG_WARNING("session.client_gone", "session", identity_.id, "pid", identity_.pid);
        {
          // Kept for --session_lease, it takes no more turns on its GPU:
          // other sessions there step as if it were gone.
          OthersLock lock(this);
          executor_->UnbindSession(identity_.id);
        }
        if (on_client_gone_) on_client_gone_(identity_.id);
        return;
      }
      continue;
    }
    last = HandleRequest(seq);
  }
}

namespace {

// The daemon-wide totals (metrics) after one step; `params`: the session's
// parameters when the step applied an update.
void AddToCounters(DaemonCounters* c, const absl::StatusOr<StepOutcome>& outcome,
                   double lock_wait_us, double snapshot_wait_us, uint64_t params) {
  constexpr auto kRelaxed = std::memory_order_relaxed;
  c->lock_wait_us.fetch_add(static_cast<uint64_t>(lock_wait_us), kRelaxed);
  c->snapshot_wait_us.fetch_add(static_cast<uint64_t>(snapshot_wait_us), kRelaxed);
  if (!outcome.ok()) {
    c->failed_steps.fetch_add(1, kRelaxed);
  } else {
    c->steps.fetch_add(1, kRelaxed);
    c->update_us.fetch_add(static_cast<uint64_t>(outcome->update_us), kRelaxed);
    if (outcome->found_inf) {
      c->skipped_steps.fetch_add(1, kRelaxed);
    } else {
      c->params_updated.fetch_add(params, kRelaxed);
      const bool split = outcome->cpu_params + outcome->gpu_params != 0;
      c->cpu_params.fetch_add(split ? outcome->cpu_params : params, kRelaxed);
      c->gpu_params.fetch_add(outcome->gpu_params, kRelaxed);
    }
    c->h2d_bytes.fetch_add(outcome->h2d_bytes, kRelaxed);
    c->d2h_bytes.fetch_add(outcome->d2h_bytes, kRelaxed);
  }
}

}  // namespace

uint32_t Session::HandleRequest(uint32_t seq) {
  auto* block = static_cast<ControlBlock*>(control_->data());
  const absl::Time start = absl::Now();
  ClearResult(&block->result);
  // One copy of the request, read once: the trainer can write its block at
  // any time, and what was validated must be what is applied.
  const StepRequest request = block->request;  // published by request_bell (acquire)
  // An early step waits for its trainer while it holds mu_: counted in the
  // gate before it locks (a snapshot queued first goes first), until it ends.
  const absl::StatusOr<StepKind> decoded = StepKind::Decode(request.flags, /*stream_ordered=*/false);
  const bool early = decoded.ok() && decoded->early();
  // Callers already waiting for mu_ (a state read, a load) go first:
  // absl::Mutex keeps no queue, and this thread, which released it a moment
  // ago, would take it again at once, step after step, while the trainer
  // keeps stepping. At most 100 ms.
  for (int i = 0; i < 2000 && others_waiting_.load(std::memory_order_relaxed) > 0; ++i) {
    absl::SleepFor(absl::Microseconds(50));
  }
  if (early) trainer_gate_.BeginEarlyStep();
  // Held from the step to the end of its delayed update (if any), which runs
  // after the result is posted: nothing reads or writes the state between
  // the two (state reads, checkpoints and resumes see whole steps). A
  // hand-off keeps holding it through the next step, which joins the update.
  absl::MutexLock lock(&mu_);
  StepLocked(seq, request, start, early, absl::ToDoubleMicroseconds(absl::Now() - start));
  while (std::optional<NextStep> next = AwaitHandOff(seq)) {
    seq = next->seq;
    StepLocked(seq, next->request, absl::Now(), /*early=*/true, 0);
  }
  return seq;
}

void Session::StepLocked(uint32_t seq, const StepRequest& request, absl::Time start, bool early,
                         double lock_wait_us) {
  auto* block = static_cast<ControlBlock*>(control_->data());
  StepRecord record;
  record.lock_wait_us = lock_wait_us;
  RunStep(seq, request, start, &record);
  if (early) trainer_gate_.EndEarlyStep();
  if (record.outcome.ok()) AddDelayFigures(request, &*record.outcome);
  // Done, skipped or failed: no waiter on any subgroup (or on the lease) may
  // be left behind.
  channel_->PostLeaseApplied(seq);
  channel_->MarkAllDone(seq, record.num_subgroups);
  const double wall_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  PostOutcome(block, record.outcome, wall_us);
  if (options_.counters != nullptr) {
    const absl::StatusOr<StepOutcome>& o = record.outcome;
    AddToCounters(options_.counters, o, record.lock_wait_us, record.snapshot_wait_us,
                  o.ok() && !o->found_inf ? summary().params : 0);
  }
  RecordStats(record, wall_us);
  last_post_ns_ = MonotonicNs();
  channel_->PostResult(seq);
}

void Session::RunStep(uint32_t seq, const StepRequest& request, absl::Time start,
                      StepRecord* record) {
  if (shard_ == nullptr) {
    record->outcome = absl::FailedPreconditionError(
        "step: the session has no registered tensors; call dos_register (RegisterShard) "
        "before the first step");
    return;
  }
  // The GPU lease first: memory a lowered lease no longer covers is given
  // back before the client, waiting on the lease bell, lets the trainer
  // allocate again. A failure here fails the step (below).
  const Policy step_policy = policy();
  const absl::Status leased =
      executor_->ApplyLease(*shard_, request, step_policy, identity_.id, delayed_.get());
  channel_->PostLeaseApplied(seq);
  // The step's kind, decided here (HandleRequest read only whether it is
  // early, for the gate); everything after runs by it. With the trainer's
  // event its GPU stream orders the step.
  const absl::StatusOr<StepKind> kind =
      StepKind::Decode(request.flags, trainer_event_ != nullptr);
  // An early step waits for its trainer: counted against its uid's
  // --max_early_steps_per_uid while it runs.
  absl::StatusOr<LedgerCharge> early =
      !kind.ok() || !kind->early()
          ? LedgerCharge()
          : account_->Charge(UidResource::kEarlySteps, 1, absl::StrCat("step: early step ", seq));
  const absl::Status admitted =
      !leased.ok() ? leased : !kind.ok() ? kind.status() : early.status();
  if (admitted.ok()) {
    const ::dos::AwaitVerdict verdict = [this, seq, start] { return AwaitVerdict(seq, start); };
    DelayedHost* delayed = DelayedFor(*kind);
    NoteWindow(request);
    record->outcome = executor_->Run(*shard_, bindings_, request, *kind, step_policy,
                                     MakeStepSync(seq, *kind, start), identity_.id, verdict,
                                     delayed);
  } else {
    record->outcome = admitted;
    // A handed-off update ends before the step's result (Run joins it).
    if (delayed_ != nullptr) executor_->JoinHandOff(*shard_, delayed_.get(), identity_.id, false);
  }
  ++steps_run_;
  StateChanged();
  record->snapshot_wait_us = shard_->TakeWriteWaitUs();
  record->num_subgroups = static_cast<uint32_t>(shard_->subgroups().size());
}

void Session::RecordStats(const StepRecord& record, double wall_us) {
  absl::MutexLock lock(&stats_mu_);
  stats_.lock_wait_us_total += record.lock_wait_us;
  stats_.lock_wait_us_max = std::max(stats_.lock_wait_us_max, record.lock_wait_us);
  stats_.snapshot_wait_us_total += record.snapshot_wait_us;
  stats_.snapshot_wait_us_max = std::max(stats_.snapshot_wait_us_max, record.snapshot_wait_us);
  if (record.outcome.ok()) {
    ++stats_.steps;
    if (record.outcome->found_inf) ++stats_.skipped_steps;
    stats_.last = *record.outcome;
    stats_.last_wall_us = wall_us;
  } else {
    ++stats_.failed_steps;
  }
}

bool Session::registered() const {
  absl::MutexLock lock(&stats_mu_);
  return summary_.registered;
}

Session::Summary Session::summary() const {
  absl::MutexLock lock(&stats_mu_);
  return summary_;
}

SessionStatsSnapshot Session::stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

}  // namespace dos
