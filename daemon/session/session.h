// Session: one attached trainer process (one rank) and everything the daemon
// holds for it: its identity and token, its control block in shared memory,
// the mappings of its tensor memory, its fp32 optimizer state (ShardState),
// its scheduling policy, its statistics, and the step thread that answers its
// doorbell.
//
// Engines: Register picks the session's executor (an engine and its planner)
// once: the host engine for tensors in shared memory, else the GPU engine of
// the device the CUDA IPC memory lives on, by the device UUID the client sent
// (ExecutorSet); all its tensors must be on that one device. Everything after
// that asks the engine, never the kind of memory again.
//
// Lifecycle: Create (at Attach) -> Register (once) -> steps over the control
// block -> Stop (detach, client death, daemon shutdown). Stop lets an
// in-flight step finish, marks the control block closed (a waiting client gets
// UNAVAILABLE) and joins the step thread.
//
// Thread-safety: all public methods are thread-safe. `mu_` serialises steps
// with registration and state transfer; statistics sit behind `stats_mu_` so
// dosctl never waits for a step.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/checkpoint/env.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/common/uid_ledger.h"
#include "daemon/sched/executor_set.h"
#include "daemon/sched/policy.h"
#include "daemon/sched/step_executor.h"
#include "daemon/sched/step_kind.h"
#include "daemon/session/daemon_counters.h"
#include "daemon/session/shard_spec.h"
#include "daemon/session/trainer_gate.h"
#include "daemon/state/register_progress.h"
#include "daemon/state/shard_state.h"
#include "daemon/transport/peer_process.h"
#include "daemon/transport/segment_inbox.h"
#include "daemon/transport/transport.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"
#include "dos/wire/unique_fd.h"

namespace dos {

struct SessionIdentity {
  uint64_t id = 0;
  std::string token;
  std::string client_name;
  int32_t pid = 0;
  int32_t rank = -1;
  int32_t local_rank = 0;
  int32_t world_size = 1;
  uint32_t generation = 0;  // 0 at Attach, +1 at each resume
  // Owner: the attaching process's uid and the process itself (a pidfd), from
  // the kernel via the descriptor socket's Hello. Null process: in-process
  // tests, where `pid` is trusted.
  uint32_t uid = 0;
  std::shared_ptr<const PeerProcess> process;
  // Whether the attaching process still runs (pidfd; else kill(pid, 0)).
  bool ClientAlive() const;
};

struct SessionOptions {
  uint64_t default_subgroup_size = 100'000'000;
  absl::Duration liveness_interval = absl::Milliseconds(200);
  DaemonCounters* counters = nullptr;  // daemon-wide totals (metrics); may be null
  uint64_t memory_limit = 0;           // bytes of state per session; 0 = no cap
  bool huge_pages = true;              // transparent huge pages for large shards' state
  uint32_t max_sessions = 0;           // sessions held at once (live + orphaned); 0 = no cap
  uint32_t max_sessions_per_uid = 0;   // of them, per owner uid; 0 = no cap
  // Longest an early step waits, from its begin, for one subgroup's
  // gradients to be marked ready (overlap="update": the GPU engine is held
  // meanwhile, so a trainer that stalls mid-backward would hold up the other
  // trainers on its GPU) or for its verdict (the node counts its engine as
  // stepping, and the session's lock is held, until then).
  absl::Duration early_ready_timeout = absl::Minutes(10);
  // Per-uid and per-session bounds (mapped bytes, early steps, bookkeeping,
  // tensors) are charged here; null: a private ledger without bounds.
  // Outlives the sessions.
  UidLedger* ledger = nullptr;
};

// Smallest subgroup a registration gets (smaller requests are raised to it):
// each subgroup is its own page-aligned allocation.
inline constexpr uint64_t kMinSubgroupSize = 256;

struct SessionStatsSnapshot {
  uint64_t steps = 0;
  uint64_t skipped_steps = 0;
  uint64_t failed_steps = 0;
  StepOutcome last;
  double last_wall_us = 0;
  // Time step requests waited for the session lock (held by checkpoint
  // snapshots, state transfer): the checkpoint stall as the trainer sees it.
  double lock_wait_us_total = 0;
  double lock_wait_us_max = 0;
  // Time steps spent copying subgroups for an in-flight checkpoint before
  // overwriting them (copy-on-write; the rest of the checkpoint stall).
  double snapshot_wait_us_total = 0;
  double snapshot_wait_us_max = 0;  // of one step
};

// What Snapshot() did.
struct SnapshotInfo {
  int64_t step = 0;          // the snapshot's step (LatestStep of its tensors)
  double locked_us = 0;      // time the session lock was held (marking the boundary)
  double write_us = 0;       // the snapshot off the lock: `write`, while steps went on
  uint32_t subgroups_copied_by_steps = 0;  // copied by steps before they wrote them
  double last_step_wall_us = 0;
  // Whose state it is (Session::StateOwner): what the checkpoint names.
  CheckpointOwner owner;
};

class Session {
 public:
  // Creates the control block and starts the step thread. `on_client_gone`
  // is called (from the step thread) once the client's process has exited.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      SessionIdentity identity, const SessionOptions& options, const Policy& policy,
      const ExecutorSet* executors, HostMemoryBudget* budget,
      std::function<void(uint64_t id)> on_client_gone);
  ~Session();  // Stop()s.

  // Maps the tensors, validates them and initialises the state from the
  // trainer's weights. FAILED_PRECONDITION if already registered.
  absl::Status Register(const ShardSpec& spec);
  // One RegisterShard call at a time, before its request is converted:
  // FAILED_PRECONDITION at once while another runs or once the shard is
  // registered (calls sent together on a session whose step holds mu_ each
  // held a thread and a copy of their request until the step let go).
  // EndRegister() after each admitted call.
  absl::Status BeginRegister();
  void EndRegister() { registering_.store(false); }

  // State transfer of elements [offset, offset + count) of one tensor (count
  // 0: the whole tensor, offset 0): count fp32 master weights, exp_avg and
  // exp_avg_sq back to back at `buf`. Import rewrites the trainer's weights
  // of the range from the new masters and sets the tensor's step.
  // The owner's zero-copy view of its state (ShardState::ExportStateMemory),
  // after bringing resident subgroups' state home: taken between steps.
  absl::StatusOr<ShardState::StateMemory> ExportStateMemory();
  absl::StatusOr<int64_t> ExportState(uint32_t tensor, uint64_t offset, uint64_t count,
                                      const MemoryRef& buf);
  absl::Status ImportState(uint32_t tensor, uint64_t offset, uint64_t count, const MemoryRef& buf,
                           int64_t step);

  void SetPolicy(const Policy& policy);
  Policy policy() const;

  // Checkpoints. Snapshot marks a step boundary of the state (HeldState)
  // under the lock, then calls `write` with the boundary's layout (step
  // counts, hyperparameters, owner) off the lock while steps go on, and
  // ends the snapshot whatever `write` returns (its error is returned).
  // `write` reads the state through ShardState::SnapshotAcquire (see
  // SaveSnapshot); a step about to write a subgroup not yet read copies it
  // into a `pool` buffer first, or waits for the writer when the pool is
  // spent (ShardState's copy-on-write). ABORTED instead of waiting when an
  // early step holds the session (TrainerGate): the checkpointer saves the
  // other sessions meanwhile.
  using SnapshotWrite =
      absl::FunctionRef<absl::Status(const CheckpointLayout& layout, ShardState& shard)>;
  absl::StatusOr<SnapshotInfo> Snapshot(SnapshotPool* pool, SnapshotWrite write);
  // True from before an early step takes the session's lock until it ends
  // (it may wait for its trainer's ready words or verdict, up to
  // --early_step_ready_timeout): a Snapshot now would wait that long, so
  // saves take the other sessions first (Checkpointer).
  bool AwaitingTrainer() const { return trainer_gate_.waiting(); }
  // True once no step waits for the trainer, false if one still does at
  // `deadline` (woken when the wait ends, not polled).
  bool WaitUntilNotAwaitingTrainer(absl::Time deadline) const {
    return trainer_gate_.WaitUntilNone(deadline);
  }
  // Loads a checkpoint file into the state and rewrites the trainer's
  // weights; the state is untouched if the file is corrupt or of another
  // layout. Returns the loaded step count. `env`: the checkpoint store's
  // (StoreEnv), through which the file is opened.
  absl::StatusOr<int64_t> LoadCheckpoint(const std::string& path, Env* env);
  // Moves on with every change of the state (a step, a state write, a
  // checkpoint load); equal values mean the same state. Lock-free.
  uint64_t state_version() const { return state_version_.load(); }

  // Crash survival and restart. TakeShard (after Stop) moves the state out
  // and drops the dead client's mappings; AdoptShard gives it to the session
  // of the resumed process, whose Register then checks the layout and
  // rewrites the weights instead of reading them. SetRestoreCandidates gives
  // checkpoint files (best first) that Register loads the first matching of,
  // through `env` (the checkpoint store's; it outlives the session).
  // A session whose Register refused the adopted state (another model) holds
  // it unregistered (HoldsAdoptedState): when it detaches or its client
  // exits, the state waits again for the rest of a lease, and TakeShard
  // gives it to the next try.
  // AdoptShard's `owner` is the client whose state it is (StateOwner of the
  // session it was taken from): a checkpoint of it names that client, not
  // the one that tried to resume, while it is held unregistered.
  std::unique_ptr<ShardState> TakeShard();
  void AdoptShard(std::unique_ptr<ShardState> shard, CheckpointOwner owner);
  // Whose state this session holds: its own client's, or while it holds
  // adopted state unregistered, that state's owner.
  CheckpointOwner StateOwner() const;
  bool HoldsAdoptedState() const { return holds_adopted_.load(std::memory_order_acquire); }
  // Whether it holds state a checkpoint saves: registered, or adopted and
  // held unregistered (Snapshot saves that too, so that state waiting for
  // the right resume survives `dosctl checkpoint save` and dosd's stop).
  bool HoldsState() const { return registered() || HoldsAdoptedState(); }
  void SetRestoreCandidates(std::vector<std::string> paths, Env* env);
  bool registered() const;
  // True when no step thread watches this session (it never registered) and
  // its client process is gone: the reaper's liveness check.
  bool ClientGoneWithoutThread() const;

  // Finishes any in-flight step, closes the control block, joins the thread.
  void Stop();
  // Tells the step thread to stop after its in-flight step, without waiting:
  // a shutdown asks every session first, then Stop()s each (the waits overlap).
  void RequestStop();

  const SessionIdentity& identity() const { return identity_; }
  bool TokenMatches(absl::string_view token) const;
  uint64_t control_block_bytes() const { return control_->size(); }
  // The control block's memfd (tests map a dup of it).
  int control_fd() const { return control_->fd(); }
  // A descriptor of the control block for the trainer (what the descriptor
  // socket sends): a new open file of its memfd, not a dup, so that once the
  // session is gone dosd can tell whether a process still maps the block.
  // The first call opens dosd's own writable descriptor for that; when the
  // session is destroyed it goes to budget_ (HostMemoryBudget::
  // HoldBlockWhileMapped) with one kClosedBlocks charge to the uid, which
  // counts as a session (--max_sessions_per_uid) until nothing maps the block.
  absl::StatusOr<UniqueFd> ControlBlockFd();
  // Whether a registration of `tensors` tensors with `bookkeeping_bytes`
  // (kBookkeepingBytesPerTensor each plus their names) would be charged now:
  // RESOURCE_EXHAUSTED as Register would answer. Charges nothing; lets the
  // RPC layer refuse a hopeless request before it copies it.
  absl::Status CheckBookkeeping(uint64_t tensors, uint64_t bookkeeping_bytes) const;

  // Segments the client sent over the descriptor socket, waiting for use.
  SegmentInbox* inbox() { return &inbox_; }
  // The session's share of its uid's bounds (UidLedger).
  const std::shared_ptr<UidLedger::Account>& account() const { return account_; }
  // Keeps the client's descriptor-socket connection open until the session
  // stops: its hang-up tells the client (in any pid namespace) that dosd or
  // the session is gone.
  void HoldClientConnection(UniqueFd connection);

  struct Summary {
    bool registered = false;
    uint64_t params = 0;
    uint32_t tensors = 0;
    uint32_t subgroups = 0;
    uint64_t state_bytes = 0;
    StateFormat state_format = StateFormat::kFp32;
    int64_t step = 0;            // at registration (resumed or restored)
    std::string restored_from;   // "" / "resume" / checkpoint path
    // Per tensor: the first and last subgroup holding its elements (what a
    // trainer waits for before it reads the tensor's new weights).
    std::vector<std::pair<uint32_t, uint32_t>> tensor_subgroups;
    // The GPU engine the session runs on (its tensors' device): CUDA ordinal
    // in dosd and UUID; -1 and "": host memory (CPU mode) or not registered.
    int gpu_device = -1;
    std::string gpu_uuid;
  };
  Summary summary() const;
  SessionStatsSnapshot stats() const;
  // The registration in flight (phase kRegisterIdle when none); never blocks
  // on a registration.
  RegisterProgress::View register_progress() const { return register_progress_->Read(); }

 private:
  Session(SessionIdentity identity, const SessionOptions& options, const Policy& policy,
          const ExecutorSet* executors, HostMemoryBudget* budget,
          std::function<void(uint64_t)> on_client_gone);
  void StepLoop();
  // Runs `locked` (an absl::Status() callable) under mu_, reached through the
  // trainer gate (snapshots, state reads and writes, checkpoint loads: calls
  // whose threads serve every user); ABORTED, naming `what`, after 1 s when
  // an early step holds the session for its trainer, and after 10 s when a
  // step holds it otherwise.
  template <typename Locked>
  absl::Status ThroughGate(absl::string_view what, Locked locked) ABSL_LOCKS_EXCLUDED(mu_)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;  // a polled TryLock the analysis cannot follow
  // Starts the step thread (once; not after Stop()). RESOURCE_EXHAUSTED
  // where the system has no thread to give (the session then stops: a
  // thrown std::system_error would have ended dosd and every session).
  absl::Status StartStepThread();
  // One step request (`seq`), in parts: HandleRequest reads the request
  // once and clears the result; RunStep (under mu_) applies the lease,
  // decodes the step's kind (StepKind::Decode: the only place its flags are
  // read), admits it and runs it; PostOutcome and RecordStats report it.
  struct StepRecord {
    absl::StatusOr<StepOutcome> outcome;
    double lock_wait_us = 0;
    double snapshot_wait_us = 0;  // copy-on-write copies for an in-flight checkpoint
    uint32_t num_subgroups = 0;
  };
  // Returns the last seq it handled: with a hand-off, the steps after `seq`
  // it ran under the same lock.
  uint32_t HandleRequest(uint32_t seq);
  // Under mu_: the step from its run to its result.
  void StepLocked(uint32_t seq, const StepRequest& request, absl::Time start, bool early,
                  double lock_wait_us) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a step's result, with its delayed update running: the trainer's
  // next step, when it begins early and delays the host path before the
  // update ends (--delayed_handoff; no snapshot queued, no one else waiting
  // for mu_), counted in the gate and handed the update (its seq and request,
  // read once); otherwise the update is joined here (RunDelayedUpdate).
  struct NextStep {
    uint32_t seq;
    StepRequest request;
  };
  std::optional<NextStep> AwaitHandOff(uint32_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The delayed host path (daemon/sched/delayed_host.h): the session's
  // DelayedHost for its shard (made at the first step that needs one); the
  // trainer's window before a request; the update after the result; the
  // pending weights installed before anything else writes the trainer's
  // memory or state outside a step.
  DelayedHost* DelayedFor(StepKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteWindow(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunDelayedUpdate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status InstallPendingWeights() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddDelayFigures(const StepRequest& request, StepOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void ClearResult(StepResult* result);
  void RunStep(uint32_t seq, const StepRequest& request, absl::Time start, StepRecord* record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PostOutcome(ControlBlock* block, const absl::StatusOr<StepOutcome>& outcome,
                   double wall_us);
  void RecordStats(const StepRecord& record, double wall_us) ABSL_LOCKS_EXCLUDED(stats_mu_);
  bool ClientAlive() const;
  // Step `seq`'s channel to the trainer: its event, the progress words, the
  // ready words (waited for within early_ready_timeout of `begun`, the
  // step's begin, as its verdict is; polled when the trainer's stream writes
  // them, `kind.stream_ordered()`) and the late skip mask. Which of them the
  // step uses is its kind's business (StepExecutor::Run).
  StepSync MakeStepSync(uint32_t seq, StepKind kind, absl::Time begun) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Early steps (dos/wire/control_block.h): wait, on the step thread or an
  // engine's, until subgroup `subgroup`'s gradients of step `seq` are final,
  // or until the verdict of step `seq` is published (a copy of it). Both give
  // up with UNAVAILABLE when the session stops or its trainer is gone, and
  // with DEADLINE_EXCEEDED `early_ready_timeout` after the step's begin (a
  // trainer alive but stalled must not hold its engine or the node's share
  // forever); a verdict bell rung past `seq` is INVALID_ARGUMENT at once.
  // `stream_written`: the trainer's GPU stream writes the ready words (no
  // futex wake comes; the wait backs off instead).
  absl::Status WaitReady(uint32_t subgroup, uint32_t seq, absl::Time begun,
                         bool stream_written) const;
  absl::StatusOr<StepRequest> AwaitVerdict(uint32_t seq, absl::Time begun) const;
  // Why an early step's wait gives up (OK while it may go on).
  absl::Status EarlyStepAlive(const char* waiting_for) const;

  // Register's steps (session_register.cc), in order.
  struct Registration;
  absl::Status ChargeBookkeeping(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PickExecutor(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MapTensors(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ResumeState(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status NewState(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BindEngine(const ShardSpec& spec, Registration* reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Publish(Registration* reg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Checks the range (count 0 becomes the tensor's numel) and where `buf`
  // lies in `seg`, the segment it names (taken from the inbox before the
  // lock, so that a refused call still gives it back).
  absl::StatusOr<float*> MapStateBuffer(uint32_t tensor, uint64_t offset, uint64_t* count,
                                        const MemoryRef& buf, ShmSegment* seg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionIdentity identity_;
  const SessionOptions options_;
  const ExecutorSet* const executors_;
  // The executor (engine and planner) the session's steps run on: the host
  // one until Register picks the one of the tensors' memory.
  StepExecutor* executor_ ABSL_GUARDED_BY(mu_);
  Engine* engine() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return executor_->engine(); }
  // The state it holds: registered, else adopted (null: none).
  ShardState* HeldState() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shard_ != nullptr ? shard_.get() : adopted_.get();
  }
  HostMemoryBudget* const budget_;
  const std::function<void(uint64_t)> on_client_gone_;
  // Declared before everything charged through them (segments, early steps):
  // destroyed after.
  std::unique_ptr<UidLedger> own_ledger_;  // when options.ledger is null
  std::shared_ptr<UidLedger::Account> account_;
  // The registered tensors' bookkeeping, charged to the uid (tensors,
  // bytes) at Register for the session's life. Not to `budget_`: that is
  // the optimizer state's and its delayed buffers' (host_state_bytes).
  LedgerCharge tensors_charge_ ABSL_GUARDED_BY(mu_);
  LedgerCharge bookkeeping_charge_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<ShmSegment> control_;
  absl::Mutex block_mu_;
  UniqueFd block_lease_ ABSL_GUARDED_BY(block_mu_);  // ControlBlockFd's tracking descriptor
  // Unmaps the control block, then hands block_lease_ to budget_ (~Session).
  void ReleaseControlBlock();
  std::unique_ptr<ControlBlockChannel> channel_;
  // Mirrored into the control block for the trainer's log.
  std::unique_ptr<RegisterProgress> register_progress_;
  SegmentInbox inbox_;
  absl::Status ResolveSegments(ShardSpec* spec);
  absl::Mutex conn_mu_;
  std::vector<UniqueFd> client_connections_ ABSL_GUARDED_BY(conn_mu_);

  mutable absl::Mutex mu_;
  std::unique_ptr<Transport> transport_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ShardState> shard_ ABSL_GUARDED_BY(mu_);
  // Steps run on the shard, and the count at which the GPU-resident state
  // was last copied to the host: a state export streamed in many ranged
  // calls copies it once, not once per call.
  int64_t steps_run_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t resident_synced_at_ ABSL_GUARDED_BY(mu_) = -1;
  // Moves on (under mu_) with every change of the state: a step, a state
  // write, a checkpoint load. Read without the lock (state_version()). From
  // one counter for every Session, so that a resumed session (a new Session
  // under the same id) never repeats a version its predecessor had.
  static std::atomic<uint64_t> last_state_version_;
  std::atomic<uint64_t> state_version_{++last_state_version_};
  void StateChanged() { state_version_.store(++last_state_version_); }
  std::vector<TensorBinding> bindings_ ABSL_GUARDED_BY(mu_);
  // For shard_ (null: none yet); its buffers are charged to budget_ until
  // it is reset (a new shard, a checkpoint load, TakeShard) or destroyed.
  std::unique_ptr<DelayedHost> delayed_ ABSL_GUARDED_BY(mu_);
  uint64_t last_post_ns_ ABSL_GUARDED_BY(mu_) = 0;  // MonotonicNs when the last result was posted
  // GPU mode: the trainer's IPC event, opened at Register; null otherwise.
  void* trainer_event_ ABSL_GUARDED_BY(mu_) = nullptr;
  void CloseTrainerEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::unique_ptr<ShardState> adopted_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> holds_adopted_{false};  // adopted_, not yet registered (off mu_)
  mutable absl::Mutex owner_mu_;            // not mu_: StateOwner waits for no step
  CheckpointOwner adopted_owner_ ABSL_GUARDED_BY(owner_mu_);
  // Snapshot() calls copying `shard_` off `mu_` (TakeShard waits for none).
  absl::Mutex snap_mu_ ABSL_ACQUIRED_AFTER(mu_);
  int snapshot_copiers_ ABSL_GUARDED_BY(snap_mu_) = 0;
  std::vector<std::string> restore_candidates_ ABSL_GUARDED_BY(mu_);
  Env* restore_env_ ABSL_GUARDED_BY(mu_) = nullptr;

  mutable absl::Mutex stats_mu_;
  SessionStatsSnapshot stats_ ABSL_GUARDED_BY(stats_mu_);
  Policy policy_ ABSL_GUARDED_BY(stats_mu_);
  Summary summary_ ABSL_GUARDED_BY(stats_mu_);

  std::atomic<bool> stop_{false};
  absl::Mutex thread_mu_;
  std::thread step_thread_ ABSL_GUARDED_BY(thread_mu_);
  std::atomic<bool> thread_started_{false};
  std::atomic<bool> stopped_{false};  // Stop() ran (closes the block once)
  // Early steps (HandleRequest) against snapshots queued for mu_.
  mutable TrainerGate trainer_gate_;
  // Threads waiting for mu_ other than the step loop's (OthersLock): a
  // hand-off gives way to them (AwaitHandOff), and the next step lets them
  // take it first (HandleRequest).
  std::atomic<int> others_waiting_{0};
  std::atomic<bool> registering_{false};  // BeginRegister .. EndRegister
  // mu_ for anything but the step loop, counted in others_waiting_ while it
  // waits.
  class ABSL_SCOPED_LOCKABLE OthersLock {
   public:
    explicit OthersLock(Session* s) ABSL_EXCLUSIVE_LOCK_FUNCTION(s->mu_) : mu_(&s->mu_) {
      s->others_waiting_.fetch_add(1, std::memory_order_relaxed);
      mu_->Lock();
      s->others_waiting_.fetch_sub(1, std::memory_order_relaxed);
    }
    ~OthersLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
    OthersLock(const OthersLock&) = delete;
    OthersLock& operator=(const OthersLock&) = delete;

   private:
    absl::Mutex* const mu_;
  };
};

}  // namespace dos
