#include "daemon/session/checkpointer.h"

#include <pthread.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

namespace fs = std::filesystem;

constexpr char kSuffix[] = ".dckpt";

// Client names are free text; file names keep [A-Za-z0-9._-].
std::string SafeName(absl::string_view name) {
  std::string out;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '-' || c == '_';
    out.push_back(ok ? c : '_');
  }
  if (out.empty() || out[0] == '.') out.insert(out.begin(), '_');
  return out.substr(0, 128);
}

bool IsWithin(const fs::path& root, const fs::path& p) {
  auto r = root.begin();
  auto q = p.begin();
  for (; r != root.end(); ++r, ++q) {
    if (r->empty()) continue;  // trailing separator
    if (q == p.end() || *r != *q) return false;
  }
  return true;
}

struct Candidate {
  int64_t step;
  uint64_t created;
  std::string path;
};

// Files under `dir` (recursively) that are DOS checkpoints of (name, rank),
// best first. Only the header and layout are read here.
std::map<SessionManager::RestoreKey, std::vector<Candidate>> Scan(const std::string& dir) {
  std::map<SessionManager::RestoreKey, std::vector<Candidate>> found;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec) || !absl::EndsWith(it->path().filename().string(), kSuffix)) {
      continue;
    }
    const std::string path = it->path().string();
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r =
        CheckpointReader::Open(path, Env::Default());
    if (!r.ok()) {
      DOS_LOG_WARNING("checkpoint.scan_skipped", "path", path, "error", r.status().message());
      continue;
    }
    const CheckpointLayout& l = (*r)->layout();
    found[{l.owner, l.rank}].push_back(
        {l.tensors.empty() ? 0 : l.tensors[0].step, (*r)->created_unix_seconds(), path});
  }
  for (auto& [key, list] : found) {
    std::sort(list.begin(), list.end(), [](const Candidate& a, const Candidate& b) {
      return std::tie(a.step, a.created, a.path) > std::tie(b.step, b.created, b.path);
    });
  }
  return found;
}

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options, SessionManager* sessions)
    : options_(std::move(options)), sessions_(sessions) {}

Checkpointer::~Checkpointer() { Stop(); }

absl::Status Checkpointer::Start() {
  std::error_code ec;
  fs::create_directories(options_.dir, ec);
  if (ec || !fs::is_directory(options_.dir, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint_dir=", options_.dir, " is not a directory and cannot be created (",
        ec.message(), "); create it writable by the daemon's user"));
  }
  // Temporaries of a writer killed mid-checkpoint (this daemon, SIGKILLed).
  int removed = 0;
  for (fs::recursive_directory_iterator it(options_.dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    absl::StatusOr<int> n = RemoveStaleCheckpointTemporaries(it->path().string(), Env::Default());
    if (n.ok()) removed += *n;
  }
  absl::StatusOr<int> n = RemoveStaleCheckpointTemporaries(options_.dir, Env::Default());
  if (n.ok()) removed += *n;
  auto candidates = ScanForRestore(options_.dir);
  DOS_LOG_INFO("checkpoint.start", "dir", options_.dir, "stale_temporaries_removed", removed,
               "restorable", candidates.size(), "autosave_interval",
               absl::FormatDuration(options_.autosave_interval), "autosave_keep",
               options_.autosave_keep);
  for (const auto& [key, paths] : candidates) {
    DOS_LOG_INFO("checkpoint.restorable", "client", key.first, "rank", key.second, "latest",
                 paths.front(), "files", paths.size());
  }
  if (options_.restore) sessions_->SetRestoreCandidates(std::move(candidates));
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

std::map<SessionManager::RestoreKey, std::vector<std::string>> Checkpointer::ScanForRestore(
    const std::string& dir) {
  std::map<SessionManager::RestoreKey, std::vector<std::string>> out;
  for (auto& [key, list] : Scan(dir)) {
    for (Candidate& c : list) out[key].push_back(std::move(c.path));
  }
  return out;
}

absl::StatusOr<std::string> Checkpointer::Resolve(const std::string& path,
                                                  absl::string_view field) const {
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(options_.dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("checkpoint dir ", options_.dir,
                                                            ": ", ec.message()));
  fs::path p(path);
  if (p.is_relative()) p = root / p;
  const fs::path resolved = fs::weakly_canonical(p, ec);  // follows symlinks that exist
  if (ec || !IsWithin(root, resolved)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " '", path, "' is outside the checkpoint directory ", root.string(),
        "; give a path relative to it (dosd --checkpoint_dir)"));
  }
  return resolved.string();
}

std::string Checkpointer::DefaultPath(const Session& session, absl::string_view kind,
                                      int64_t step) const {
  const SessionIdentity& id = session.identity();
  return (fs::path(options_.dir) / absl::StrCat(SafeName(id.client_name), ".r", id.rank) /
          absl::StrFormat("%s-%012d%s", kind, step, kSuffix))
      .string();
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Save(uint64_t session_id,
                                                                 const std::string& path) {
  absl::StatusOr<std::vector<CheckpointRecord>> result;
  bool done = false;
  absl::MutexLock lock(&mu_);
  if (!started_ || stop_) {
    return absl::UnavailableError("checkpoint: the checkpointer is not running");
  }
  jobs_.push_back(Job{session_id, path, false, &result, &done});
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
    absl::StatusOr<std::vector<CheckpointRecord>> r = Run(job);
    if (job.result != nullptr) {
      absl::MutexLock lock(&mu_);
      *job.result = std::move(r);
      *job.done = true;
    }
  }
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Run(const Job& job) {
  std::vector<std::shared_ptr<Session>> targets;
  if (job.session_id != 0) {
    absl::StatusOr<std::shared_ptr<Session>> s = sessions_->FindUnchecked(job.session_id);
    if (!s.ok()) {
      for (auto& o : sessions_->ListOrphans()) {
        if (o->identity().id == job.session_id) s = o;
      }
    }
    if (!s.ok()) return s.status();
    targets.push_back(*s);
  } else {
    for (auto& s : sessions_->List()) targets.push_back(s);
    for (auto& s : sessions_->ListOrphans()) targets.push_back(s);
  }
  std::vector<CheckpointRecord> out;
  for (const auto& s : targets) {
    if (!s->registered()) {
      if (job.session_id != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint: session ", job.session_id, " has not registered its tensors yet"));
      }
      continue;
    }
    const uint64_t id = s->identity().id;
    std::string path;
    if (!job.path.empty()) {
      if (job.session_id != 0) {
        DOS_ASSIGN_OR_RETURN(path, Resolve(job.path, "checkpoint path"));
      } else {
        DOS_ASSIGN_OR_RETURN(std::string dir, Resolve(job.path, "checkpoint path"));
        const SessionIdentity& sid = s->identity();
        path = (fs::path(dir) / absl::StrCat(SafeName(sid.client_name), ".r", sid.rank, ".s",
                                             sid.id, kSuffix))
                   .string();
      }
    }
    absl::StatusOr<CheckpointRecord> rec = SaveOne(s, path, job.autosave);
    if (!rec.ok()) {
      DOS_LOG_WARNING("checkpoint.failed", "session", id, "autosave", job.autosave, "error",
                      rec.status().message());
      if (job.session_id != 0 || !job.autosave) return rec.status();
      continue;
    }
    if (!rec->path.empty()) out.push_back(*rec);
  }
  // Staging copies of sessions that are gone are freed.
  for (auto it = staging_.begin(); it != staging_.end();) {
    bool live = false;
    for (const auto& s : targets) live |= s->identity().id == it->first;
    if (!live && job.session_id == 0) {
      it = staging_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

absl::StatusOr<CheckpointRecord> Checkpointer::SaveOne(const std::shared_ptr<Session>& s,
                                                       const std::string& resolved_path,
                                                       bool autosave) {
  const uint64_t id = s->identity().id;
  DOS_ASSIGN_OR_RETURN(SnapshotInfo snap, s->Snapshot(&staging_[id], &staging_budget_));
  CheckpointRecord rec;
  rec.session_id = id;
  rec.step = snap.step;
  rec.snapshot_us = snap.locked_us;
  rec.copy_ms = snap.copy_us / 1e3;
  rec.subgroups_copied_by_steps = snap.subgroups_copied_by_steps;
  rec.last_step_wall_us = snap.last_step_wall_us;
  if (autosave) {
    auto last = autosaved_step_.find(id);
    if (last != autosaved_step_.end() && last->second == snap.step) return rec;  // unchanged
  }
  std::string path = resolved_path;
  if (autosave || path.empty()) path = DefaultPath(*s, autosave ? "auto" : "step", snap.step);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const absl::Time start = absl::Now();
  const SessionIdentity& sid = s->identity();
  DOS_RETURN_IF_ERROR(SaveShard(*staging_[id], path, Env::Default(),
                                CheckpointOwner{sid.client_name, sid.rank, sid.world_size}));
  rec.write_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  rec.path = path;
  rec.bytes = fs::file_size(path, ec);
  DOS_LOG_INFO("checkpoint.saved", "session", id, "path", path, "step", snap.step, "bytes",
               rec.bytes, "snapshot_us", snap.locked_us, "copy_ms", rec.copy_ms,
               "copied_by_steps", snap.subgroups_copied_by_steps, "write_ms", rec.write_ms,
               "last_step_wall_us", snap.last_step_wall_us, "autosave", autosave);
  if (autosave) {
    autosaved_step_[id] = snap.step;
    PruneAutosaves(fs::path(path).parent_path().string());
  }
  return rec;
}

void Checkpointer::PruneAutosaves(const std::string& subdir) {
  std::vector<std::string> autos;
  std::error_code ec;
  for (fs::directory_iterator it(subdir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (absl::StartsWith(name, "auto-") && absl::EndsWith(name, kSuffix)) {
      autos.push_back(it->path().string());
    }
  }
  std::sort(autos.begin(), autos.end());  // zero-padded steps sort by step
  const size_t keep = static_cast<size_t>(std::max(options_.autosave_keep, 1));
  for (size_t i = 0; i + keep < autos.size(); ++i) {
    fs::remove(autos[i], ec);
    DOS_LOG_INFO("checkpoint.pruned", "path", autos[i]);
  }
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Load(std::shared_ptr<Session> session,
                                                                 const std::string& path) {
  std::vector<std::shared_ptr<Session>> targets;
  if (session != nullptr) {
    targets.push_back(std::move(session));
  } else {
    targets = sessions_->List();
  }
  DOS_ASSIGN_OR_RETURN(std::string resolved, Resolve(path, "checkpoint path"));
  std::error_code ec;
  const bool is_dir = fs::is_directory(resolved, ec);
  if (!is_dir && targets.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint path '", path, "' is a file; loading every session needs a directory"));
  }
  std::vector<CheckpointRecord> out;
  auto found = is_dir ? Scan(resolved) : decltype(Scan(resolved)){};
  for (const auto& s : targets) {
    if (!s->registered()) continue;
    const SessionIdentity& id = s->identity();
    std::vector<std::string> files;
    if (is_dir) {
      for (const Candidate& c : found[{id.client_name, id.rank}]) files.push_back(c.path);
      if (files.empty()) {
        if (targets.size() > 1) continue;
        return absl::NotFoundError(absl::StrCat(
            "checkpoint: no checkpoint of client '", id.client_name, "' rank ", id.rank,
            " under ", resolved));
      }
    } else {
      files.push_back(resolved);
    }
    absl::Status last;
    for (const std::string& f : files) {
      absl::StatusOr<int64_t> step = s->LoadCheckpoint(f);
      if (step.ok()) {
        CheckpointRecord rec;
        rec.session_id = id.id;
        rec.path = f;
        rec.step = *step;
        rec.bytes = fs::file_size(f, ec);
        out.push_back(rec);
        last = absl::OkStatus();
        break;
      }
      last = step.status();
    }
    if (!last.ok()) return last;
  }
  return out;
}

}  // namespace dos
