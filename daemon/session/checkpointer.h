// Checkpointer: the daemon's checkpoints of sessions' optimizer state, under
// one directory (--checkpoint_dir).
//
// Saving is asynchronous with respect to training, and needs no second copy
// of the state: under the session's lock only a step boundary is marked
// (Session::Snapshot, which takes the layout: step counts, hyperparameters);
// this thread then writes the file (SaveSnapshot: temporary file, fsync,
// rename, fsync of the directory) straight from the state while steps go
// on, letting each subgroup go once the file is past it. A step about to
// write a subgroup the file has not reached copies it first into a buffer
// of the checkpointer's SnapshotPool (--checkpoint_staging_limit, charged to
// --host_memory_limit and checked against the host's and the cgroup's room;
// freed once written), or, with the pool spent, waits until the file is past
// it: a save holds at most that limit beside the state (at 7B fp32 the state
// is 81 GB; a full copy would double it), and the steps behind a slow disk
// wait at most for the write. Save() queues a
// job on that thread and waits for it; autosave queues itself every
// --autosave_interval.
//
// Paths are relative to the owner's folder; absolute paths elsewhere and `..`
// are refused (INVALID_ARGUMENT), and every file operation goes through the
// store's directory descriptor, one folder at a time without following a
// link (StoreEnv), so a link anywhere below the store, planted or swapped in
// at any moment, fails the operation (INVALID_ARGUMENT naming it and the
// fix) instead of leading dosd out. Default names:
//   <client>.r<rank>/step-<step>.s<session>.dckpt   explicit saves (kept)
//   <client>.r<rank>/auto-<step>.s<session>.dckpt   autosaves (the session's
//                                                   newest --autosave_keep kept)
// (two jobs of one name and rank, a sweep of `train.py`, share the folder:
// the session id keeps each from overwriting or pruning the other's files).
//
// Restart rule: Start() scans every *.dckpt file under the directory, reads
// its header and layout (owner = client name, rank, the highest step among
// its tensors, when it was written) and hands the SessionManager, per
// (client name, rank), the files newest first (ties: the higher step). The first trainer that
// attaches with that client name and rank takes them; its registration loads the first whose layout
// (tensor count, names, numel, groups, dtypes, weight-decay mode) matches and verifies (every CRC)
// and rewrites its weights from the masters.
//
// Thread-safety: all public methods are thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/checkpoint/store_env.h"
#include "daemon/session/session_manager.h"
#include "daemon/session/user_folders.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/state/snapshot_pool.h"

namespace dos {

// Every checkpoint file's name ends so; scans descend at most so many folders
// below an owner's folder, and a checkpoint path has at most as many.
inline constexpr char kCheckpointSuffix[] = ".dckpt";
inline constexpr int kMaxCheckpointDepth = 16;

struct CheckpointerOptions {
  std::string dir = "/var/lib/dos/checkpoints";  // every checkpoint lives under here
  absl::Duration autosave_interval = absl::ZeroDuration();  // 0: no autosave
  int autosave_keep = 2;     // autosaves kept per (client, rank)
  bool restore = true;       // offer the latest checkpoints to re-attaching trainers
  // A save of every session (autosave or `dosctl checkpoint save` without
  // a session) saves the sessions whose step waits for its trainer (an
  // early step before its verdict: Session::AwaitingTrainer) after the
  // others, and gives such a session up to this long to finish waiting (a
  // backward) before leaving it out: an autosave skips it (and later
  // autosaves skip it at once while it still waits), an explicit save
  // fails naming it after saving the others. One stalled trainer (dosd
  // waits for it up to --early_step_ready_timeout) delays no one else's
  // checkpoints.
  absl::Duration stalled_trainer_wait = absl::Seconds(5);
  // Who may keep how much in the store (--checkpoint_quota), and whose
  // folders dosd trusts (UserFolders).
  UserFoldersOptions folders;
  // Host memory steps may copy subgroups into while a save is in flight
  // (SnapshotPool): kAutoStagingLimit is a quarter of the host's memory.
  uint64_t staging_limit = kAutoStagingLimit;
  static constexpr uint64_t kAutoStagingLimit = UINT64_MAX;
  // The daemon's budget (--host_memory_limit) the pool's buffers are also
  // charged to; null: the pool's limit alone.
  HostMemoryBudget* host_budget = nullptr;
};

struct CheckpointRecord {
  uint64_t session_id = 0;
  std::string path;
  int64_t step = 0;
  uint64_t bytes = 0;
  double snapshot_us = 0;        // session lock held (marking the step boundary)
  double copy_ms = 0;            // the snapshot off the lock (the write, beside steps)
  uint32_t subgroups_copied_by_steps = 0;  // copy-on-write copies made by steps
  double write_ms = 0;
  double last_step_wall_us = 0;
};

class Checkpointer {
 public:
  Checkpointer(CheckpointerOptions options, SessionManager* sessions);
  ~Checkpointer();  // Stop()s.

  // Creates the directory if needed (a warning, checkpoint.dir_not_writable,
  // names it and the fix when dosd may not write there), removes temporaries
  // of killed writers, scans for restore candidates and starts the writer
  // thread.
  absl::Status Start();
  // Finishes the queued jobs and joins the thread.
  void Stop();

  // session_id 0: every registered (or orphaned) session. Blocks the caller
  // until written; training continues meanwhile. How long: the jobs queued
  // before it (one writer thread, in order), then per session the copy of
  // its state and the file write (its state's bytes at the copy and disk
  // speeds), plus up to stalled_trainer_wait per session that waits for its
  // trainer (an early step before its verdict); such a session is left out
  // and named in a FAILED_PRECONDITION after the others are saved. One
  // session's `path` is resolved under its owner's folder before queueing
  // (INVALID_ARGUMENT at once, field "path").
  absl::StatusOr<std::vector<CheckpointRecord>> Save(uint64_t session_id,
                                                     const std::string& path);
  // Deletes `path` (resolved under uid `owner`'s folder: a file, or every
  // checkpoint under a folder) on the writer thread, after the saves queued
  // before it. The caller checked that it may act for `owner`.
  absl::StatusOr<UserFolders::Deleted> Delete(uint32_t owner, const std::string& path);
  // Each uid's last measured usage of the store (empty before Start()).
  std::map<uint32_t, CheckpointUsage> Usage() const;
  uint64_t quota() const { return options_.folders.quota_bytes; }

  // `session` may be null: every registered session (path a directory).
  // One session's `path` is resolved first (INVALID_ARGUMENT, field "path").
  // Runs on the caller's thread: reads and verifies each file (its bytes at
  // disk speed).
  absl::StatusOr<std::vector<CheckpointRecord>> Load(std::shared_ptr<Session> session,
                                                     const std::string& path);

  // `path` resolved under uid `owner`'s folder; INVALID_ARGUMENT naming
  // `field` if it is absolute, has a `..` or meets a symlink there.
  absl::StatusOr<std::string> Resolve(uint32_t owner, const std::string& path,
                                      absl::string_view field) const;
  // <dir>/uid-<uid>: every checkpoint of uid's sessions lies under it.
  std::string UserDir(uint32_t uid) const;
  // Forgets the autosave bookkeeping of sessions that are gone (neither
  // attached nor waiting for a resume). Called when the SessionManager
  // reports a session closed.
  void ForgetSession(uint64_t session_id);

  // Latest per (uid, client, rank) under the store's trusted uid-<uid>/
  // folders (UserFolders), as described above; measures each folder's usage.
  // *last_id: the highest session id a file name in them carries (else as given).
  std::map<SessionManager::RestoreKey, std::vector<std::string>> ScanForRestore(uint64_t* last_id);

 private:
  struct Job {
    uint64_t session_id = 0;
    std::string path;      // as the caller gave it
    std::string resolved;  // one session's path, resolved by Save() ("": none)
    bool autosave = false;
    uint64_t forget = 0;  // != 0: forget this closed session's autosave bookkeeping only
    absl::StatusOr<std::vector<CheckpointRecord>>* result = nullptr;  // null: nobody waits
    bool* done = nullptr;
    std::function<void()> task;  // set: only run this (then set *done)
  };
  void WriterLoop();
  // A live session, or one whose trainer died and that waits for a resume.
  absl::StatusOr<std::shared_ptr<Session>> FindLiveOrOrphan(uint64_t id) const;
  absl::StatusOr<std::vector<CheckpointRecord>> Run(const Job& job);
  // False when `s` still waits for its trainer after stalled_trainer_wait
  // (for an autosave: at once if it did at the last autosave too).
  bool WaitUntilNotAwaitingTrainer(const Session& s, bool autosave);
  // `resolved_path` empty (or `autosave`): the default name; ending in "/": a
  // file named for the session in that folder. ABORTED
  // instead of queueing behind an early step that holds the session waiting
  // for its trainer (Session::Snapshot).
  absl::StatusOr<CheckpointRecord> SaveOne(const std::shared_ptr<Session>& session,
                                           const std::string& resolved_path, bool autosave);
  // SaveOne once WaitUntilNotAwaitingTrainer says no early step holds the
  // session (again, a few times, when one begins in between); ABORTED when
  // one still does.
  absl::StatusOr<CheckpointRecord> SaveUnlessAwaiting(const std::shared_ptr<Session>& session,
                                                      const std::string& path, bool autosave);
  std::string DefaultPath(uint32_t uid, const CheckpointOwner& owner, absl::string_view kind,
                          int64_t step, uint64_t session) const;
  // `written` is the session's newest autosave: deletes its oldest beyond
  // --autosave_keep, in the order they were written.
  void PruneAutosaves(const std::string& written, uint64_t session);
  // Where `job` saves session `s`: empty (SaveOne names the file), a
  // folder ending in '/', or a .dckpt file in the owner's folder.
  absl::StatusOr<std::string> SessionPath(const Job& job, const Session& s);

  const CheckpointerOptions options_;
  SessionManager* const sessions_;
  // The store's folder and every file operation in it (set by Start()).
  std::unique_ptr<StoreEnv> store_;
  std::unique_ptr<UserFolders> folders_;  // over store_ (set by Start())
  SnapshotPool pool_;                     // steps' copy-on-write copies while a save is in flight

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;

  // Writer thread only.
  std::map<uint64_t, uint64_t> autosaved_version_;  // Session::state_version() last autosaved
  std::map<uint64_t, std::vector<std::string>> autosaves_;  // each session's, oldest first
  std::set<uint64_t> autosave_skipped_;  // waiting for their trainer at the last autosave
};

}  // namespace dos
