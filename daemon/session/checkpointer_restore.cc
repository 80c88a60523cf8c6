// Checkpointer, restoring: the scan of the store at start (which state to
// offer re-attaching trainers) and loads into live sessions.
#include <algorithm>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/common/log.h"
#include "daemon/session/checkpointer.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

struct Candidate {
  int64_t step;
  uint64_t created;
  std::string path;
};

// The session id a file dosd named carries ("auto-000000000012.s7.dckpt",
// "job.r-0.s7.dckpt": 7), else 0. Users name files too: an id past 2**48
// (which no run reaches) is not taken, so no name can run the ids out.
uint64_t SessionIdOf(absl::string_view name) {
  name = absl::StripSuffix(name, kCheckpointSuffix);
  const size_t dot = name.rfind(".s");
  uint64_t id = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(name.substr(dot + 2), &id)) return 0;
  return id <= (uint64_t{1} << 48) ? id : 0;
}

// Files under `dir` (recursively, through the store's descriptors, never a
// link) that are DOS checkpoints, added to `found` under (`uid`, name, rank);
// `last_id` (if not null) raised to the highest session id a name carries.
// Only the header and layout are read here.
void ScanInto(StoreEnv& store, const std::string& dir, uint32_t uid, int depth,
              std::map<SessionManager::RestoreKey, std::vector<Candidate>>* found,
              uint64_t* last_id) {
  absl::StatusOr<std::vector<StoreEnv::Entry>> entries = store.List(dir);
  if (!entries.ok()) {
    DOS_LOG_WARNING("checkpoint.scan_skipped", "path", dir, "error", entries.status().message());
    return;
  }
  for (const StoreEnv::Entry& e : *entries) {
    const std::string path = absl::StrCat(absl::StripSuffix(dir, "/"), "/",
                                          e.name);  // a folder given as "uid-1/": no "//"
    if (e.kind == StoreEnv::Kind::kDirectory && depth < kMaxCheckpointDepth) {
      ScanInto(store, path, uid, depth + 1, found, last_id);
      continue;
    }
    if (e.kind != StoreEnv::Kind::kFile || !absl::EndsWith(e.name, kCheckpointSuffix)) continue;
    if (last_id != nullptr) *last_id = std::max(*last_id, SessionIdOf(e.name));
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(path, &store);
    if (!r.ok()) {
      DOS_LOG_WARNING("checkpoint.scan_skipped", "path", path, "error", r.status().message());
      continue;
    }
    const CheckpointLayout& l = (*r)->layout();
    (*found)[{uid, l.owner, l.rank}].push_back(
        {LatestStep(l.tensors), (*r)->created_unix_seconds(), path});
  }
}

std::map<SessionManager::RestoreKey, std::vector<Candidate>> Scan(StoreEnv& store,
                                                                  const std::string& dir,
                                                                  uint32_t uid, uint64_t* last_id) {
  std::map<SessionManager::RestoreKey, std::vector<Candidate>> found;
  ScanInto(store, dir, uid, 0, &found, last_id);
  for (auto& [key, list] : found) {
    // Newest first: the state the trainer last had, also after it rolled
    // back to an earlier step or a new run of the job started over.
    std::sort(list.begin(), list.end(), [](const Candidate& a, const Candidate& b) {
      return std::tie(a.created, a.step, a.path) > std::tie(b.created, b.step, b.path);
    });
  }
  return found;
}

}  // namespace

std::map<SessionManager::RestoreKey, std::vector<std::string>> Checkpointer::ScanForRestore(
    uint64_t* last_id) {
  std::map<SessionManager::RestoreKey, std::vector<std::string>> out;
  absl::StatusOr<std::vector<StoreEnv::Entry>> owners = store_->List(store_->root());
  if (!owners.ok()) {
    DOS_LOG_WARNING("checkpoint.scan_skipped", "path", store_->root(), "error",
                    owners.status().message());
    return out;
  }
  for (const StoreEnv::Entry& e : *owners) {
    uint32_t uid = 0;
    if (!UserFolders::ParseName(e.name, &uid)) continue;
    // Only the folders dosd made for that uid (never a link, nor one another
    // uid's folder was renamed to).
    if (absl::Status st = folders_->Trust(uid, false); !st.ok()) {
      DOS_LOG_WARNING("checkpoint.folder_untrusted", "uid", uid, "error", st.message());
      continue;
    }
    folders_->Measure(uid);
    for (auto& [key, list] : Scan(*store_, folders_->Dir(uid), uid, last_id)) {
      for (Candidate& c : list) out[key].push_back(std::move(c.path));
    }
  }
  return out;
}

absl::StatusOr<std::vector<CheckpointRecord>> Checkpointer::Load(std::shared_ptr<Session> session,
                                                                 const std::string& path) {
  std::vector<std::shared_ptr<Session>> targets;
  // One session's path is resolved once, first (as Save() does); every
  // session's per owner below.
  std::string resolved_one;
  if (session != nullptr) {
    DOS_ASSIGN_OR_RETURN(resolved_one, Resolve(session->identity().uid, path, "path"));
    targets.push_back(std::move(session));
  } else {
    targets = sessions_->List();
  }
  if (store_ == nullptr) {
    return absl::UnavailableError("checkpoint: the checkpointer is not running");
  }
  std::vector<CheckpointRecord> out;
  std::vector<std::string> stalled;  // waiting for their trainer: named in the error
  for (const auto& s : targets) {
    if (!s->registered()) continue;
    const SessionIdentity& id = s->identity();
    std::string resolved = resolved_one;
    if (resolved.empty()) {
      DOS_ASSIGN_OR_RETURN(resolved, Resolve(id.uid, path, "checkpoint path"));
    }
    DOS_RETURN_IF_ERROR(folders_->Trust(id.uid, false));
    DOS_ASSIGN_OR_RETURN(StoreEnv::Kind kind, store_->KindOf(resolved));
    const bool is_dir = kind == StoreEnv::Kind::kDirectory;
    if (!is_dir && targets.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint path '", path, "' is a file; loading every session needs a directory"));
    }
    std::vector<std::string> files;
    if (is_dir) {
      auto found = Scan(*store_, resolved, id.uid, /*last_id=*/nullptr);
      for (const Candidate& c : found[{id.uid, id.client_name, id.rank}]) files.push_back(c.path);
      if (files.empty()) {
        if (targets.size() > 1) continue;
        return absl::NotFoundError(absl::StrCat("checkpoint: no checkpoint of client '",
                                                id.client_name, "' rank ", id.rank, " under ",
                                                resolved));
      }
    } else {
      files.push_back(resolved);
    }
    absl::Status last;
    for (const std::string& f : files) {
      absl::StatusOr<int64_t> step = s->LoadCheckpoint(f, store_.get());
      if (step.ok()) {
        CheckpointRecord rec;
        rec.session_id = id.id;
        rec.path = f;
        rec.step = *step;
        rec.bytes = store_->FileSize(f).value_or(0);
        out.push_back(rec);
        last = absl::OkStatus();
        break;
      }
      last = step.status();
      // Its early step waits for its trainer: an older file is no answer.
      if (absl::IsAborted(last)) break;
    }
    if (absl::IsAborted(last) && targets.size() > 1) {
      stalled.push_back(absl::StrCat("session ", id.id, " (pid ", id.pid, ")"));
      continue;
    }
    if (!last.ok()) return last;
  }
  if (!stalled.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint load: loaded ", out.size(),
                     " session(s); not loaded: ", absl::StrJoin(stalled, ", "),
                     ": its step waits for its trainer (an early step); load "
                     "it with --session once its trainer reaches step()"));
  }
  return out;
}

}  // namespace dos
