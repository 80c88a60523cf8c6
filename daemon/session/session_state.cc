// The session's state seen from outside its steps: state transfer (export,
// import, the state memory a trainer maps), checkpoints (Snapshot,
// LoadCheckpoint) and the state changing hands between sessions (TakeShard,
// AdoptShard: a crashed client's state kept for the lease and resumed).
// Every entry takes the session's lock (OthersLock) or the trainer gate's
// snapshot turn first, so none sees a half-finished step.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/common/log.h"
#include "daemon/session/session.h"
#include "daemon/transport/shm_transport.h"
#include "dos/wire/status_macros.h"

namespace dos {

// How long ThroughGate waits for a step that holds the session without an
// early step's count (one waiting on its trainer's GPU work, or a long
// checkpoint load): longer than any sane step, short for a shared thread.
constexpr absl::Duration kGateLockWait = absl::Seconds(10);
// And for an early step that holds it for its trainer's gradients or
// verdict: a trainer that steps goes on within that (its reader gets in
// between two steps), a stalled one is refused after it.
constexpr absl::Duration kGateTrainerWait = absl::Seconds(1);

template <typename Locked>
absl::Status Session::ThroughGate(absl::string_view what,
                                  Locked locked) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Through the gate (TrainerGate): not behind an early step that counted
  // itself first, which may hold mu_ until --early_step_ready_timeout. The
  // callers serve every user of the node (the descriptor socket's thread,
  // the checkpointer's): a trainer that stalls its own early step must not
  // hold them up, nor one that holds a step some other way for long.
  // Counted as waiting from here, as OthersLock: the step loop gives way (no
  // hand-off; the next step lets this in first).
  others_waiting_.fetch_add(1, std::memory_order_relaxed);
  const absl::Time trainer_deadline = absl::Now() + kGateTrainerWait;
  while (!trainer_gate_.QueueSnapshot()) {
    if (absl::Now() >= trainer_deadline || !trainer_gate_.WaitUntilNone(trainer_deadline)) {
      others_waiting_.fetch_sub(1, std::memory_order_relaxed);
      return absl::AbortedError(
          absl::StrCat(what, ": session ", identity_.id,
                       " waits for its trainer (an early step, begun "
                       "during backward, has held it for ",
                       absl::FormatDuration(kGateTrainerWait),
                       " until the trainer's step() or zero_grad()); try again after its step()"));
    }
  }
  const absl::Time deadline = absl::Now() + kGateLockWait;
  bool held = mu_.TryLock();
  while (!held && absl::Now() < deadline) {
    absl::SleepFor(absl::Microseconds(200));  // a polled try: absl::Mutex has no timed Lock
    held = mu_.TryLock();
  }
  others_waiting_.fetch_sub(1, std::memory_order_relaxed);
  trainer_gate_.SnapshotLocked();  // queued no more, whether it got mu_ or not
  if (!held) {
    return absl::AbortedError(absl::StrCat(what, ": session ", identity_.id, " was busy for ",
                                           absl::FormatDuration(kGateLockWait),
                                           " (its step waits for its trainer's GPU work, or a "
                                           "checkpoint load runs); try again later"));
  }
  absl::Status st = locked();
  mu_.Unlock();
  return st;
}

absl::StatusOr<float*> Session::MapStateBuffer(uint32_t tensor, uint64_t offset, uint64_t* count,
                                               const MemoryRef& buf, ShmSegment* seg) {
  if (shard_ == nullptr) {
    return absl::FailedPreconditionError(
        "state transfer: the session has no registered tensors; register first");
  }
  if (tensor >= shard_->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat("state transfer: tensor index ", tensor,
                                                   " is out of range; ", shard_->tensors().size(),
                                                   " are registered"));
  }
  const uint64_t numel = shard_->tensors()[tensor].numel;
  if (*count == 0) {
    if (offset != 0) {
      return absl::InvalidArgumentError(absl::StrCat("state transfer: tensor ", tensor,
                                                     ": count 0 (the whole tensor) with offset ",
                                                     offset, "; give the range's count"));
    }
    *count = numel;
  }
  if (offset > numel || *count > numel - offset) {
    return absl::OutOfRangeError(absl::StrCat("state transfer: elements [", offset, ", ",
                                              offset + *count, ") of tensor ", tensor,
                                              " are out of range; it has ", numel));
  }
  uint64_t bytes = 3 * *count * sizeof(float);
  if (buf.offset > seg->size() || bytes > seg->size() - buf.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("state transfer: buffer segment ", buf.segment_id, " has ", seg->size(),
                     " bytes; ", *count, " elements of tensor ", tensor, " need ", bytes,
                     " at offset ", buf.offset, " (3 x count fp32)"));
  }
  return reinterpret_cast<float*>(static_cast<char*>(seg->data()) + buf.offset);
}

absl::StatusOr<int64_t> Session::ExportState(uint32_t tensor, uint64_t offset, uint64_t count,
                                             const MemoryRef& buf) {
  // Buffers for state transfer are short-lived: taken first, so that every
  // path (a refusal below too) unmaps this one when the call returns.
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> holder,
                       inbox_.Take(buf.segment_id, "state transfer: buffer"));
  int64_t step = 0;
  DOS_RETURN_IF_ERROR(ThroughGate("state read", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    DOS_ASSIGN_OR_RETURN(float* out, MapStateBuffer(tensor, offset, &count, buf, holder.get()));
    if (resident_synced_at_ != steps_run_) {
      DOS_RETURN_IF_ERROR(engine()->SyncResidentToHost(*shard_));
      resident_synced_at_ = steps_run_;
    }
    for (int which = 0; which < 3; ++which) {
      shard_->ReadTensorRange(tensor, which, offset, count, out + which * count);
    }
    step = shard_->tensors()[tensor].step;
    return absl::OkStatus();
  }));
  return step;
}

absl::StatusOr<ShardState::StateMemory> Session::ExportStateMemory() {
  ShardState::StateMemory memory;
  DOS_RETURN_IF_ERROR(ThroughGate("state memory", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shard_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "state memory: session ", identity_.id, " has no registered state yet; register first"));
    }
    if (resident_synced_at_ != steps_run_) {
      DOS_RETURN_IF_ERROR(engine()->SyncResidentToHost(*shard_));
      resident_synced_at_ = steps_run_;
    }
    DOS_ASSIGN_OR_RETURN(memory, shard_->ExportStateMemory());
    // One state view per shard, charged to the uid (not the session): it
    // outlives the session while the trainer still maps the memory
    // (HostMemoryBudget::HoldWhileViewed). Only to a ledger that outlives
    // the session (a session without one keeps its own).
    if (!shard_->views_charged() && own_ledger_ == nullptr && account_ != nullptr) {
      UidLedger* ledger = account_->ledger();
      constexpr const char* kWhat = "state memory (state_dict()'s views)";
      absl::StatusOr<LedgerCharge> views =
          ledger->Charge(identity_.uid, UidResource::kStateViews, 1, kWhat);
      if (!views.ok() && budget_ != nullptr) {
        budget_->ReapViews();  // views dropped since the last reap count no more
        views = ledger->Charge(identity_.uid, UidResource::kStateViews, 1, kWhat);
      }
      if (!views.ok()) return views.status();  // `memory`'s descriptors close unsent
      shard_->set_views_charge(std::move(*views));
    }
    return absl::OkStatus();
  }));
  return memory;
}

absl::Status Session::ImportState(uint32_t tensor, uint64_t offset, uint64_t count,
                                  const MemoryRef& buf, int64_t step) {
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> holder,
                       inbox_.Take(buf.segment_id, "state transfer: buffer"));  // as above
  return ThroughGate("state write", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state transfer: step ", step, " is negative"));
    }
    DOS_ASSIGN_OR_RETURN(float* in, MapStateBuffer(tensor, offset, &count, buf, holder.get()));
    // Weights a delayed step left pending go in first: the import rewrites
    // only its own range of them.
    DOS_RETURN_IF_ERROR(InstallPendingWeights());
    shard_->ProtectSnapshot();  // an in-flight checkpoint keeps the state it began with
    // A range may cover part of a resident subgroup: the rest of it must come
    // home before the GPU copies are dropped below.
    DOS_RETURN_IF_ERROR(engine()->SyncResidentToHost(*shard_));
    for (int which = 0; which < 3; ++which) {
      shard_->WriteTensorRange(tensor, which, offset, count, in + which * count);
    }
    shard_->tensors()[tensor].step = step;
    StateChanged();
    // The host state is now the truth: resident GPU copies are dropped (the
    // next step uploads them again).
    engine()->DropResident(*shard_);
    return executor_->WriteWeightsRange(*shard_, bindings_, tensor, offset, count);
  });
}

void Session::SetPolicy(const Policy& policy) {
  absl::MutexLock lock(&stats_mu_);
  policy_ = policy;
}

Policy Session::policy() const {
  absl::MutexLock lock(&stats_mu_);
  return policy_;
}

absl::StatusOr<SnapshotInfo> Session::Snapshot(SnapshotPool* pool, SnapshotWrite write) {
  SnapshotInfo info;
  ShardState* shard = nullptr;
  CheckpointLayout layout;
  DOS_RETURN_IF_ERROR(ThroughGate("checkpoint", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time start = absl::Now();
    shard = HeldState();
    if (shard == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint: session ", identity_.id, " has no registered tensors; nothing to save"));
    }
    // Adopted state has no GPU copies (TakeShard brought them home).
    if (shard_ != nullptr) DOS_RETURN_IF_ERROR(engine()->SyncResidentToHost(*shard_));
    // Holding mu_ means no step is in flight: a step boundary. Only the
    // layout (step counts, hyperparameters) is taken here; steps after it
    // copy a subgroup before they first write it, or wait for the writer
    // (ShardState::BeforeWrite), while `write` reads the rest in place.
    info.owner = StateOwner();
    layout = LayoutOf(*shard, info.owner);
    info.step = LatestStep(shard->tensors());
    shard->BeginSnapshot(pool);
    {
      absl::MutexLock snap_lock(&snap_mu_);
      ++snapshot_copiers_;  // TakeShard waits for us to let go of `shard`
    }
    info.locked_us = absl::ToDoubleMicroseconds(absl::Now() - start);
    return absl::OkStatus();
  }));
  // Off the lock: steps go on meanwhile. `shard` stays alive until the copier
  // count drops (TakeShard waits for it; the caller's reference keeps the
  // Session, which owns it otherwise). The snapshot ends whatever `write`
  // returns, so no step waits for a writer that gave up.
  const absl::Time write_start = absl::Now();
  const absl::Status written = write(layout, *shard);
  info.subgroups_copied_by_steps = shard->EndSnapshot();
  info.write_us = absl::ToDoubleMicroseconds(absl::Now() - write_start);
  {
    absl::MutexLock snap_lock(&snap_mu_);
    --snapshot_copiers_;
  }
  DOS_RETURN_IF_ERROR(written);
  info.last_step_wall_us = stats().last_wall_us;
  return info;
}

absl::StatusOr<int64_t> Session::LoadCheckpoint(const std::string& path, Env* env) {
  int64_t step = 0;
  DOS_RETURN_IF_ERROR(ThroughGate("checkpoint load", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shard_ == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint load: session ", identity_.id,
                       " has no registered tensors; register before loading a checkpoint"));
    }
    shard_->ProtectSnapshot();  // an in-flight checkpoint keeps the state it began with
    DOS_RETURN_IF_ERROR(LoadShard(shard_.get(), path, env));
    delayed_.reset();  // every weight is rewritten below: nothing is pending any more
    engine()->DropResident(*shard_);
    for (uint32_t i = 0; i < shard_->tensors().size(); ++i) {
      DOS_RETURN_IF_ERROR(executor_->WriteWeights(*shard_, bindings_, i));
    }
    step = LatestStep(shard_->tensors());
    StateChanged();
    DOS_LOG_INFO("checkpoint.loaded", "session", identity_.id, "path", path, "step", step);
    return absl::OkStatus();
  }));
  return step;
}

std::unique_ptr<ShardState> Session::TakeShard() {
  OthersLock lock(this);
  holds_adopted_.store(false, std::memory_order_release);
  // A checkpoint's writer reads the state off the lock: wait until it has
  // let go before the state changes hands.
  {
    absl::MutexLock snap_lock(&snap_mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(snap_mu_) { return snapshot_copiers_ == 0; };
    snap_mu_.Await(absl::Condition(&idle));
  }
  if (shard_ == nullptr) return std::move(adopted_);  // never registered: what it adopted
  // The dead client's memory: unmap it (the step thread is stopped). State
  // resident on the GPU comes home first: the attachment frees it.
  bindings_.clear();
  delayed_.reset();  // a resumed session's weights are rewritten from the masters
  CloseTrainerEvent();
  if (absl::Status synced = engine()->SyncResidentToHost(*shard_); !synced.ok()) {
    DOS_LOG_ERROR("session.resident_sync_failed", "session", identity_.id, "error",
                  synced.message());
  }
  shard_->set_attachment(nullptr);
  executor_->ForgetSession(identity_.id);
  transport_.reset();
  return std::move(shard_);
}

void Session::AdoptShard(std::unique_ptr<ShardState> shard, CheckpointOwner owner) {
  OthersLock lock(this);
  {
    absl::MutexLock owner_lock(&owner_mu_);
    adopted_owner_ = std::move(owner);
  }
  adopted_ = std::move(shard);
  holds_adopted_.store(adopted_ != nullptr, std::memory_order_release);
}

CheckpointOwner Session::StateOwner() const {
  if (HoldsAdoptedState()) {
    absl::MutexLock owner_lock(&owner_mu_);
    return adopted_owner_;
  }
  return CheckpointOwner{identity_.client_name, identity_.rank, identity_.world_size};
}

void Session::SetRestoreCandidates(std::vector<std::string> paths, Env* env) {
  OthersLock lock(this);
  restore_candidates_ = std::move(paths);
  restore_env_ = env;
}

}  // namespace dos
