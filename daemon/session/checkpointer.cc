#include "daemon/session/checkpointer.h"

#include <pthread.h>
#include <sys/stat.h>

#include <cerrno>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/checkpoint/store_env.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

namespace fs = std::filesystem;

// The longest checkpoint path accepted.
constexpr size_t kMaxPathBytes = 1024;
// How often a snapshot that an early step beat to the session is tried
// again before the session is left out of this save.
constexpr int kSnapshotRetries = 3;

// Removes the temporaries of killed writers in `dir` and every folder below.
int RemoveStaleTemporaries(StoreEnv& store, const std::string& dir, int depth) {
  absl::StatusOr<int> n = RemoveStaleCheckpointTemporaries(dir, &store);
  int removed = n.ok() ? *n : 0;
  absl::StatusOr<std::vector<StoreEnv::Entry>> entries = store.List(dir);
  if (!entries.ok() || depth >= kMaxCheckpointDepth + 1) return removed;
  for (const StoreEnv::Entry& e : *entries) {
    if (e.kind == StoreEnv::Kind::kDirectory) {
      removed += RemoveStaleTemporaries(store, absl::StrCat(dir, "/", e.name), depth + 1);
    }
  }
  return removed;
}

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options, SessionManager* sessions)
    : options_(std::move(options)),
      sessions_(sessions),
      pool_(options_.staging_limit == CheckpointerOptions::kAutoStagingLimit
                ? DefaultSnapshotPoolLimit()
                : options_.staging_limit,
            options_.host_budget) {}

Checkpointer::~Checkpointer() {
  sessions_->SetOnClose(nullptr);
  Stop();
}

void Checkpointer::ForgetSession(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  if (!started_ || stop_) return;
  Job job;
  job.forget = session_id;
  jobs_.push_back(job);
}

absl::Status Checkpointer::Start() {
  absl::StatusOr<std::unique_ptr<StoreEnv>> store = StoreEnv::Open(options_.dir);
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  // A folder dosd may read but not write (another user's, read-only) still
  // restores; say so now, with the fix, rather than at the first save.
  if (absl::Status st = store_->CheckWritable(); !st.ok()) {
    DOS_LOG_WARNING("checkpoint.dir_not_writable", "dir", options_.dir, "error", st.message());
  }
  folders_ = std::make_unique<UserFolders>(store_.get(), options_.folders);
  // Temporaries of a writer killed mid-checkpoint (this daemon, SIGKILLed).
  const int removed = RemoveStaleTemporaries(*store_, store_->root(), 0);
  uint64_t last_id = 0;
  auto candidates = ScanForRestore(&last_id);
  // Session ids go on from the store's files: a new session never takes an
  // earlier run's id, whose autosaves it would prune as its own.
  sessions_->SkipIdsThrough(last_id);
  DOS_LOG_INFO("checkpoint.start", "dir", options_.dir, "stale_temporaries_removed", removed,
               "restorable", candidates.size(), "last_session_id", last_id, "autosave_interval",
               absl::FormatDuration(options_.autosave_interval), "autosave_keep",
               options_.autosave_keep);
  for (const auto& [key, paths] : candidates) {
    DOS_LOG_INFO("checkpoint.restorable", "uid", std::get<0>(key), "client", std::get<1>(key),
                 "rank", std::get<2>(key), "latest", paths.front(), "files", paths.size());
  }
  if (options_.restore) sessions_->SetRestoreCandidates(std::move(candidates), store_.get());
  // A closed session's autosave bookkeeping goes with it.
  sessions_->SetOnClose([this](uint64_t id) { ForgetSession(id); });
  absl::MutexLock lock(&mu_);
  started_ = true;
  writer_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "dos-ckpt");
    WriterLoop();
  });
  return absl::OkStatus();
}

void Checkpointer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (writer_.joinable()) writer_.join();
}

std::map<uint32_t, CheckpointUsage> Checkpointer::Usage() const {
  return folders_ != nullptr ? folders_->Usage() : std::map<uint32_t, CheckpointUsage>{};
}

absl::StatusOr<UserFolders::Deleted> Checkpointer::Delete(uint32_t owner,
                                                          const std::string& path) {
  absl::StatusOr<UserFolders::Deleted> result;
  bool done = false;
  absl::MutexLock lock(&mu_);
  if (!started_ || stop_) {
    return absl::UnavailableError("checkpoint: the checkpointer is not running");
  }
  Job job;
  job.task = [this, owner, &path, &result] { result = folders_->Delete(owner, path); };
  job.result = nullptr;
  job.done = &done;
  jobs_.push_back(std::move(job));
  mu_.Await(absl::Condition(&done));
  return result;
}

std::string Checkpointer::UserDir(uint32_t uid) const {
  return (fs::path(options_.dir) / absl::StrCat("uid-", uid)).string();
}

absl::StatusOr<std::string> Checkpointer::Resolve(uint32_t owner, const std::string& path,
                                                  absl::string_view field) const {
  // Paths reach file names, logs and operators' terminals: no control
  // characters (a newline would forge a log line, an escape drive a terminal).
  for (size_t i = 0; i < path.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(path[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has control character 0x", absl::Hex(c, absl::kZeroPad2), " at byte ", i,
          "; name checkpoints with printable characters"));
    }
  }
  const fs::path root = fs::path(UserDir(owner));
  fs::path p(path);
  bool bad = false;
  for (const fs::path& part : p) bad |= part == "..";
  if (!bad && p.is_absolute()) {
    // An absolute path (one SaveCheckpoint answered) must lie in the folder.
    const fs::path rel = p.lexically_relative(root);
    bad = rel.empty() || *rel.begin() == "..";
    p = rel;
  }
  if (bad) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " '", path, "' is outside the checkpoint folder of uid ", owner, " (",
        root.string(), "); give a path relative to it (or under it), without '..'"));
  }
  // Links below the owner's folder are refused when the store opens the
  // path (StoreEnv: one folder at a time, O_NOFOLLOW), not checked here.
  const int depth = static_cast<int>(std::distance(p.begin(), p.end()));
  if (path.size() > kMaxPathBytes || depth > kMaxCheckpointDepth + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", path.size(), " bytes and ", depth,
        " parts; a checkpoint path has at "
        "most ",
        kMaxPathBytes, " bytes and ", kMaxCheckpointDepth, " folders: give a shorter one"));
  }
  return (root / p).lexically_normal().string();
}

std::string Checkpointer::DefaultPath(uint32_t uid, const CheckpointOwner& owner,
                                      absl::string_view kind, int64_t step,
                                      uint64_t session) const {
  return (fs::path(UserDir(uid)) / RankName(owner.name, owner.rank) /
          absl::StrFormat("%s-%012d.s%d%s", kind, step, session, kCheckpointSuffix))
      .string();
}

absl::StatusOr<std::shared_ptr<Session>> Checkpointer::FindLiveOrOrphan(uint64_t id) const {
  absl::StatusOr<std::shared_ptr<Session>> s = sessions_->FindUnchecked(id);
  if (s.ok()) return s;
  for (auto& o : sessions_->ListOrphans()) {
    if (o->identity().id == id) return o;
  }
  return s.status();
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Save(uint64_t session_id,
                                                                 const std::string& path) {
  // One session's path is resolved here, once, on the caller's thread: a bad
  // path fails at once instead of after the jobs queued before it. (Every
  // session's: per owner, on the writer thread.)
  std::string resolved;
  if (session_id != 0 && !path.empty()) {
    if (absl::StatusOr<std::shared_ptr<Session>> s = FindLiveOrOrphan(session_id); s.ok()) {
      DOS_ASSIGN_OR_RETURN(resolved, Resolve((*s)->identity().uid, path, "path"));
    }
  }
  absl::StatusOr<std::vector<CheckpointRecord>> result;
  bool done = false;
  absl::MutexLock lock(&mu_);
  if (!started_ || stop_) {
    return absl::UnavailableError("checkpoint: the checkpointer is not running");
  }
  Job job;
  job.session_id = session_id;
  job.path = path;
  job.resolved = std::move(resolved);
  job.result = &result;
  job.done = &done;
  jobs_.push_back(std::move(job));
  mu_.Await(absl::Condition(&done));
  return result;
}

void Checkpointer::WriterLoop() {
  absl::Time next_autosave = options_.autosave_interval > absl::ZeroDuration()
                                 ? absl::Now() + options_.autosave_interval
                                 : absl::InfiniteFuture();
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); };
      mu_.AwaitWithDeadline(absl::Condition(&ready), next_autosave);
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      } else if (stop_) {
        return;
      } else if (absl::Now() >= next_autosave) {
        job.autosave = true;
        next_autosave = absl::Now() + options_.autosave_interval;
      } else {
        continue;
      }
    }
    if (job.task) {
      job.task();
      absl::MutexLock lock(&mu_);
      *job.done = true;
      continue;
    }
    if (job.forget != 0) {
      autosaved_version_.erase(job.forget);
      autosaves_.erase(job.forget);
      autosave_skipped_.erase(job.forget);
      continue;
    }
    absl::StatusOr<std::vector<CheckpointRecord>> r = Run(job);
    if (job.result != nullptr) {
      absl::MutexLock lock(&mu_);
      *job.result = std::move(r);
      *job.done = true;
    }
  }
}

absl::StatusOr<std::string> Checkpointer::SessionPath(const Job& job, const Session& s) {
  if (job.path.empty()) return std::string();  // SaveOne names it
  const SessionIdentity& sid = s.identity();
  std::string path;
  if (!job.resolved.empty() && sid.id == job.session_id) {
    path = job.resolved;  // Save() resolved it
  } else {
    DOS_ASSIGN_OR_RETURN(path, Resolve(sid.uid, job.path, "checkpoint path"));
  }
  DOS_ASSIGN_OR_RETURN(StoreEnv::Kind kind, store_->KindOf(path));
  const bool is_dir = kind == StoreEnv::Kind::kDirectory;
  // A folder (every session, an existing folder, "." or a trailing "/")
  // gets a file named for the session inside it (SaveOne: for whose
  // state the snapshot holds).
  if (job.session_id == 0 || is_dir || fs::path(path) == fs::path(UserDir(sid.uid)) ||
      job.path.back() == '/' || fs::path(job.path).filename() == ".") {
    return (fs::path(path) / "").string();
  }
  if (!absl::EndsWith(path, kCheckpointSuffix)) {
    // Loads of a folder and dosd's restart look for this suffix only:
    // a file without it would be saved and then never found.
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", job.path, "' does not end in ", kCheckpointSuffix,
                     " (folder loads and dosd's restart find only such files): save as '", job.path,
                     kCheckpointSuffix, "', or give a folder"));
  }
  return path;
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Run(const Job& job) {
  std::vector<std::shared_ptr<Session>> targets;
  if (job.session_id != 0) {
    absl::StatusOr<std::shared_ptr<Session>> s = FindLiveOrOrphan(job.session_id);
    if (!s.ok()) return s.status();
    targets.push_back(*s);
  } else {
    for (auto& s : sessions_->List()) targets.push_back(s);
    for (auto& s : sessions_->ListOrphans()) targets.push_back(s);
  }
  const bool every_session = job.session_id == 0;
  // Every session's save (save all, the final one at SIGTERM) goes on past
  // one that fails or waits for its trainer: one user's full quota, a
  // folder squatting on a file's name or a stalled trainer must not cost
  // the others their state. Those left out are named in the error.
  std::vector<std::string> stalled, failed;
  if (every_session) {
    // Sessions waiting for their trainer last (stable: otherwise in order).
    std::stable_partition(targets.begin(), targets.end(),
                          [](const std::shared_ptr<Session>& s) { return !s->AwaitingTrainer(); });
  }
  std::vector<CheckpointRecord> out;
  for (const auto& s : targets) {
    if (!s->HoldsState()) {
      if (job.session_id != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint: session ", job.session_id, " has not registered its tensors yet"));
      }
      continue;
    }
    const uint64_t id = s->identity().id;
    absl::StatusOr<std::string> path = SessionPath(job, *s);
    // A session whose step waits for its trainer is left out after a bounded
    // wait, not waited for up to --early_step_ready_timeout: the checkpointer
    // serves every user of the node, one save at a time.
    absl::StatusOr<CheckpointRecord> rec =
        path.ok() ? SaveUnlessAwaiting(s, *path, job.autosave) : path.status();
    if (absl::IsAborted(rec.status())) {
      if (!job.autosave) stalled.push_back(absl::StrCat("session ", id, " (pid ",
                                                        s->identity().pid, ")"));
      if (!every_session) break;
      continue;
    }
    if (!rec.ok()) {
      DOS_LOG_WARNING("checkpoint.failed", "session", id, "autosave", job.autosave, "error",
                      rec.status().message());
      if (!every_session) return rec.status();
      if (!job.autosave) {
        failed.push_back(absl::StrCat("session ", id, " (pid ", s->identity().pid,
                                      "): ", rec.status().message()));
      }
      continue;
    }
    if (!rec->path.empty()) out.push_back(*rec);
  }
  if (!stalled.empty() || !failed.empty()) {
    std::vector<std::string> saved;
    for (const CheckpointRecord& r : out) saved.push_back(r.path);
    std::string why =
        absl::StrCat("checkpoint: saved ", out.size(), " session(s)", saved.empty() ? "" : " (",
                     absl::StrJoin(saved, ", "), saved.empty() ? "" : ")");
    if (!failed.empty()) absl::StrAppend(&why, "; failed: ", absl::StrJoin(failed, "; "));
    if (!stalled.empty()) {
      absl::StrAppend(
          &why, "; not saved: ", absl::StrJoin(stalled, ", "),
          ": its step waits for its trainer's gradients or verdict (an early step before step()) "
          "and still did after ",
          absl::FormatDuration(options_.stalled_trainer_wait),
          "; save it with --session once its trainer reaches step(), or close the trainer");
    }
    return absl::FailedPreconditionError(why);
  }
  return out;
}

bool Checkpointer::WaitUntilNotAwaitingTrainer(const Session& s, bool autosave) {
  const uint64_t id = s.identity().id;
  // An explicit save always waits: the trainer may be in an ordinary backward.
  const absl::Time deadline =
      absl::Now() + (autosave && autosave_skipped_.count(id) ? absl::ZeroDuration()
                                                             : options_.stalled_trainer_wait);
  if (!s.WaitUntilNotAwaitingTrainer(deadline)) {
    if (autosave && autosave_skipped_.insert(id).second) {
      DOS_LOG_WARNING("checkpoint.autosave_skipped", "session", id, "pid", s.identity().pid,
                      "reason", "a step waits for this trainer's gradients or verdict",
                      "waited", absl::FormatDuration(options_.stalled_trainer_wait),
                      "next_try", "each autosave, until that step ends");
    }
    return false;
  }
  if (autosave) autosave_skipped_.erase(id);
  return true;
}

absl::StatusOr<CheckpointRecord> Checkpointer::SaveUnlessAwaiting(
    const std::shared_ptr<Session>& s, const std::string& path, bool autosave) {
  // An early step that began after the wait makes Snapshot give up instead
  // of queueing behind it: wait again, a few times.
  for (int attempt = 0; attempt <= kSnapshotRetries; ++attempt) {
    if (!WaitUntilNotAwaitingTrainer(*s, autosave)) break;
    absl::StatusOr<CheckpointRecord> rec = SaveOne(s, path, autosave);
    if (!absl::IsAborted(rec.status())) return rec;
  }
  return absl::AbortedError(absl::StrCat("checkpoint: session ", s->identity().id,
                                         " waits for its trainer"));
}

absl::StatusOr<CheckpointRecord> Checkpointer::SaveOne(const std::shared_ptr<Session>& s,
                                                       const std::string& resolved_path,
                                                       bool autosave) {
  const uint64_t id = s->identity().id;
  const SessionIdentity& sid = s->identity();
  CheckpointRecord rec;
  rec.session_id = id;
  bool touched_store = false;  // the folder's usage is measured again only then
  // Runs off the session's lock with the snapshot in flight: steps that
  // reach a subgroup the file has not may wait for it (pool spent), so
  // nothing here waits on anything but the store.
  // Read before the snapshot: the state saved is this version's or a later
  // one, so an equal version later means nothing changed since.
  const uint64_t version = s->state_version();
  if (autosave) {
    auto last = autosaved_version_.find(id);
    if (last != autosaved_version_.end() && last->second == version) return rec;  // unchanged
  }
  auto write = [&](const CheckpointLayout& layout, ShardState& shard) -> absl::Status {
    const int64_t step = LatestStep(layout.tensors);
    const CheckpointOwner owner{layout.owner, layout.rank, layout.world_size};
    std::string path = resolved_path;
    if (autosave || path.empty()) {
      path = DefaultPath(sid.uid, owner, autosave ? "auto" : "step", step, id);
    } else if (path.back() == '/') {
      absl::StrAppend(&path, RankName(owner.name, owner.rank), ".s", id, kCheckpointSuffix);
    }
    // Every folder and file through the store's descriptors (StoreEnv): a
    // link anywhere below the store fails the save instead of leading out;
    // only into the folder dosd made for the owner, and within its quota.
    DOS_RETURN_IF_ERROR(folders_->Trust(sid.uid, true));
    touched_store = true;
    // A store remounted read-only says so, before the quota and free-space
    // checks that would otherwise ask for room (it may be full as well).
    DOS_RETURN_IF_ERROR(store_->CheckWritable());
    DOS_RETURN_IF_ERROR(folders_->MakeRoom(sid.uid, LayoutFileBytes(layout), path));
    DOS_RETURN_IF_ERROR(store_->CreateDirs(DirName(path), 0700));
    const absl::Time start = absl::Now();
    const absl::Status saved = SaveSnapshot(layout, shard, path, store_.get());
    rec.write_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (saved.ok()) rec.path = path;
    if (!saved.ok()) folders_->RemoveEmptyFolders(sid.uid, DirName(path));  // made for it
    return saved;
  };
  absl::StatusOr<SnapshotInfo> snap = s->Snapshot(&pool_, write);
  // Not after a snapshot that never reached the store (ABORTED while the trainer was
  // mid-step, retried): a walk of the owner's folder for each attempt that wrote nothing.
  if (touched_store) folders_->Measure(sid.uid);
  if (!snap.ok()) return snap.status();
  rec.step = snap->step;
  rec.snapshot_us = snap->locked_us;
  rec.copy_ms = snap->write_us / 1e3;
  rec.subgroups_copied_by_steps = snap->subgroups_copied_by_steps;
  rec.last_step_wall_us = snap->last_step_wall_us;
  if (rec.path.empty()) return rec;
  rec.bytes = store_->FileSize(rec.path).value_or(0);
  DOS_LOG_INFO("checkpoint.saved", "session", id, "uid", sid.uid, "path", rec.path, "step",
               rec.step, "bytes", rec.bytes, "snapshot_us", rec.snapshot_us, "write_ms",
               rec.write_ms, "copied_by_steps", rec.subgroups_copied_by_steps, "staging_peak",
               pool_.TakePeak(), "last_step_wall_us", rec.last_step_wall_us, "autosave", autosave);
  if (autosave) {
    autosaved_version_[id] = version;
    PruneAutosaves(rec.path, id);
    folders_->Measure(sid.uid);
  }
  return rec;
}

void Checkpointer::PruneAutosaves(const std::string& written, uint64_t session) {
  // In the order they were written, not by the step in their names: a
  // trainer that rolled back (loaded an earlier step) writes lower steps
  // after higher ones, and its newest file is the one to keep.
  std::vector<std::string>& files = autosaves_[session];
  std::erase(files, written);  // the same name written again: now the newest
  files.push_back(written);
  const size_t keep = static_cast<size_t>(std::max(options_.autosave_keep, 1));
  const size_t excess = files.size() > keep ? files.size() - keep : 0;
  std::vector<std::string> left;
  for (size_t i = 0; i < files.size(); ++i) {
    if (i < excess) {
      absl::Status st = store_->DeleteFile(files[i]);
      if (st.ok() || absl::IsNotFound(st)) {  // gone already (a delete, the quota): pruned
        if (st.ok()) DOS_LOG_INFO("checkpoint.pruned", "path", files[i]);
        continue;
      }
      DOS_LOG_WARNING("checkpoint.prune_failed", "path", files[i], "error", st.message());
    }
    left.push_back(files[i]);  // kept, or tried again after the next autosave
  }
  files = std::move(left);
}

}  // namespace dos
