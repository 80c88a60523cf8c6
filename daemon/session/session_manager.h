// SessionManager: the table of attached sessions.
//
// It hands out session ids and tokens, finds sessions for the RPC layer
// (checking tokens), removes them on Detach, and reaps sessions whose client
// process exited (the session's step thread notices and reports it; a reaper
// thread stops and frees the session so its memory returns to the budget).
// Shutdown() drains: every session finishes its in-flight step, then stops.
//
// Crash survival: with a lease (> 0), a registered session whose client died
// is not freed but orphaned: its step thread is stopped (the in-flight step,
// if any, ran to completion, so the state is at a step boundary) and its
// state kept for the lease. Attach with `resume` = (id, token) of that
// session, by a process whose old pid is gone, creates a new session with the
// same id and token that adopts the state; a lease that runs out frees it.
//
// Restart: SetRestoreCandidates gives, per (uid, client_name, rank),
// checkpoint files best first; the first Attach of that uid, name and rank
// takes them and its Register loads the first whose layout matches.
//
// Thread-safety: all methods are thread-safe; `mu_` guards the table only and
// is never held while a session stops.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/session/session.h"

namespace dos {

class SessionManager {
 public:
  // lease 0: sessions of dead clients are freed at once. `executors` (one per
  // GPU engine, and the host one) outlive the manager; each session picks
  // its own at Register.
  SessionManager(const SessionOptions& options, const Policy& default_policy,
                 const ExecutorSet* executors, HostMemoryBudget* budget,
                 absl::Duration lease = absl::ZeroDuration());
  ~SessionManager();  // Shutdown()s.

  // `resume_id` != 0: re-attach to orphaned session `resume_id` with its
  // token (NOT_FOUND if it is unknown or its lease ran out,
  // PERMISSION_DENIED for a wrong token, FAILED_PRECONDITION while its old
  // process still lives). *resumed says whether state was adopted.
  absl::StatusOr<std::shared_ptr<Session>> Attach(SessionIdentity identity,
                                                  uint64_t resume_id = 0,
                                                  absl::string_view resume_token = "",
                                                  bool* resumed = nullptr);
  // NOT_FOUND for an unknown id, PERMISSION_DENIED for a wrong token.
  absl::StatusOr<std::shared_ptr<Session>> Find(uint64_t id, absl::string_view token) const;
  // For operator calls (dosctl) that need no token: read-only views, policy.
  absl::StatusOr<std::shared_ptr<Session>> FindUnchecked(uint64_t id) const;
  absl::Status Detach(uint64_t id, absl::string_view token);
  std::vector<std::shared_ptr<Session>> List() const;
  // Sessions whose trainer died and whose state waits for a resume.
  std::vector<std::shared_ptr<Session>> ListOrphans() const;
  // How long orphaned session `id` still waits for a resume (zero: it is
  // not orphaned, or its lease is over and the reaper frees it).
  absl::Duration OrphanLeaseLeft(uint64_t id) const;
  // The daemon's executors: its GPU engines' devices, for stats.
  const ExecutorSet* executors() const { return executors_; }

  // Per uid: its sessions (attached and orphaned) and what it holds of each
  // resource the ledger bounds (SessionOptions::ledger; nothing without one),
  // for dosctl stats and metrics.
  struct UidUsage {
    uint32_t sessions = 0;
    UidAmounts used{};
  };
  std::map<uint32_t, UidUsage> UsageByUid() const;
  // What counts as uid's sessions against --max_sessions_per_uid: attached,
  // orphaned, and closed ones whose control block a process still maps.
  uint64_t SessionsOf(uint32_t uid) const;
  // The per-uid and per-session bounds (all 0 without a ledger).
  UidLimits Limits() const;
  uint32_t max_sessions_per_uid() const { return options_.max_sessions_per_uid; }

  // (owner uid, client_name, rank): a client names its job, the kernel its
  // user, so no one is offered another user's state.
  using RestoreKey = std::tuple<uint32_t, std::string, int32_t>;
  // Opened through `env` (the checkpoint store's; it outlives the manager's
  // sessions).
  void SetRestoreCandidates(std::map<RestoreKey, std::vector<std::string>> candidates, Env* env);
  // New sessions' ids start after `last` (the highest an earlier run's
  // checkpoint names carry), unless they are past it already.
  void SkipIdsThrough(uint64_t last);

  // Called with a session's id when it is closed for good (detached, its
  // client gone without a lease, lease expired, shutdown); not on resume.
  // Runs on the closing thread; must not call back into the manager.
  void SetOnClose(std::function<void(uint64_t)> on_close);

  Policy default_policy() const;
  void SetDefaultPolicy(const Policy& policy);

  // The first half of a drain: every session takes no step after its
  // in-flight one, and a step waiting for its trainer (an early step's
  // ready words or verdict) ends within a liveness slice with nothing
  // applied, so that a final checkpoint finds every session at a step
  // boundary instead of waiting --early_step_ready_timeout for a stalled
  // trainer. The state stays until Shutdown().
  void StopTakingSteps();
  void Shutdown();

  // A hold on `session` for the descriptor server's SessionPort: the
  // session's last reference, if this is it, drops on the reaper thread, not
  // on the one thread that serves every client's descriptors (freeing a 7B
  // model's state takes seconds). After Shutdown(), where it is dropped.
  std::shared_ptr<void> HoldForPort(std::shared_ptr<Session> session);

 private:
  void OnClientGone(uint64_t id, uint32_t generation);
  // RESOURCE_EXHAUSTED when another session would pass --max_sessions or
  // uid's --max_sessions_per_uid.
  absl::Status CheckCaps(uint32_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t SessionsOfLocked(uint32_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountCreatingLocked(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CreatedLocked(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // one creating_ less
  void LookAgainAtClosedBlocks(uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  void ReapLoop();
  void StopAndFree(std::shared_ptr<Session> session, absl::string_view why);
  // A resumed session whose Register refused the state it adopted (detached,
  // or its client exited): moved to orphans_ for another lease, so that a
  // wrong model's try does not lose the state. False: not such a session.
  bool KeepAdopted(std::shared_ptr<Session>& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Orphaned {
    std::shared_ptr<Session> session;  // stopped; holds the state
    absl::Time deadline;
  };

  const SessionOptions options_;
  const ExecutorSet* const executors_;
  HostMemoryBudget* const budget_;
  const absl::Duration lease_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // (id, generation): a resumed session reuses its id, not its generation.
  std::vector<std::pair<uint64_t, uint32_t>> gone_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Orphaned> orphans_ ABSL_GUARDED_BY(mu_);
  std::map<RestoreKey, std::vector<std::string>> restore_ ABSL_GUARDED_BY(mu_);
  Env* restore_env_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // New sessions past CheckCaps, not yet in sessions_ (Session::Create runs
  // off mu_): counted by CheckCaps, so attaches at once cannot all pass.
  std::map<uint32_t, uint64_t> creating_ ABSL_GUARDED_BY(mu_);
  uint64_t creating_total_ ABSL_GUARDED_BY(mu_) = 0;
  Policy default_policy_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void(uint64_t)> on_close_ ABSL_GUARDED_BY(mu_);
  // Holds the descriptor server let go of (HoldForPort), for the reaper.
  std::vector<std::shared_ptr<Session>> released_ ABSL_GUARDED_BY(mu_);
  std::thread reaper_;
};

}  // namespace dos
