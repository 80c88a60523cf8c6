#include "daemon/session/user_folders.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "uid-";
// As deep as a checkpoint path may go (Checkpointer::Resolve), plus one.
constexpr int kMaxDepth = 17;

std::string Normal(const std::string& path) {
  std::string n = fs::path(path).lexically_normal().string();
  while (n.size() > 1 && n.back() == '/') n.pop_back();
  return n;
}

// Deletes every regular file under `dir` but the marker, then the folders
// emptied below it (not `dir` itself).
void RemoveTree(StoreEnv& store, const std::string& dir, int depth, UserFolders::Deleted* out) {
  absl::StatusOr<std::vector<StoreEnv::Entry>> entries = store.List(dir);
  if (!entries.ok()) return;
  for (const StoreEnv::Entry& e : *entries) {
    const std::string path = absl::StrCat(dir, "/", e.name);
    if (e.kind == StoreEnv::Kind::kDirectory && depth < kMaxDepth) {
      RemoveTree(store, path, depth + 1, out);
      if (absl::Status st = store.DeleteDir(path); !st.ok()) {
        DOS_LOG_WARNING("checkpoint.delete_failed", "path", path, "error", st.message());
      }
    } else if (e.kind == StoreEnv::Kind::kFile && e.name != UserFolders::kMarker) {
      const uint64_t bytes = store.FileSize(path).value_or(0);
      if (absl::Status st = store.DeleteFile(path); !st.ok()) {
        DOS_LOG_WARNING("checkpoint.delete_failed", "path", path, "error", st.message());
        if (out->failed++ == 0) out->first_error = st;
        continue;
      }
      out->paths.push_back(path);
      out->bytes += bytes;
    }
  }
}

}  // namespace

std::string JobFolderName(std::string_view name) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                    (c == '.' && i > 0);
    if (ok) {
      out.push_back(c);
    } else {
      absl::StrAppendFormat(&out, "%%%02X", static_cast<unsigned char>(c));
    }
  }
  if (out.empty()) return "%";
  if (out.size() > 128) {
    uint64_t h = 14695981039346656037ull;  // FNV-1a: the same on every build and run
    for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    out = absl::StrCat(out.substr(0, 100), "~", absl::Hex(h, absl::kZeroPad16));
  }
  return out;
}

std::string RankName(std::string_view client_name, int32_t rank) {
  return absl::StrCat(JobFolderName(client_name), ".r", rank);
}

std::string UserFolders::Dir(uint32_t uid) const {
  return absl::StrCat(store_->root(), store_->root() == "/" ? "" : "/", kPrefix, uid);
}

bool UserFolders::ParseName(const std::string& name, uint32_t* uid) {
  absl::string_view n = name;
  return absl::ConsumePrefix(&n, kPrefix) && !n.empty() && absl::ascii_isdigit(n[0]) &&
         absl::SimpleAtoi(n, uid) && absl::StrCat(kPrefix, *uid) == name;
}

absl::Status UserFolders::WriteMarker(uint32_t uid) {
  const std::string path = absl::StrCat(Dir(uid), "/", kMarker);
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f, store_->NewWritableFile(path, 0600));
  const std::string text = absl::StrCat(uid, "\n");
  DOS_ASSIGN_OR_RETURN(size_t n, f->Write(text.data(), text.size()));
  if (n != text.size()) return ErrnoToStatus(EIO, "write", path);
  DOS_RETURN_IF_ERROR(f->Sync());
  DOS_RETURN_IF_ERROR(f->Close());
  return store_->SyncDir(Dir(uid));
}

absl::Status UserFolders::Trust(uint32_t uid, bool create) {
  const std::string dir = Dir(uid);
  DOS_ASSIGN_OR_RETURN(StoreEnv::Info info, store_->Stat(dir));
  if (info.kind == StoreEnv::Kind::kMissing) {
    if (!create) return absl::OkStatus();
    DOS_RETURN_IF_ERROR(store_->CreateDirs(dir, 0700));
    return WriteMarker(uid);
  }
  std::string why;
  if (info.kind != StoreEnv::Kind::kDirectory) {
    why = "is not a folder (a link or another kind of file)";
  } else if (info.owner != ::geteuid()) {
    why = absl::StrCat("is owned by uid ", info.owner, ", not by dosd's uid ", ::geteuid());
  } else if ((info.mode & 077) != 0) {
    why = absl::StrFormat("has mode %04o (dosd makes its folders 0700)", info.mode);
  } else {
    const std::string marker = absl::StrCat(dir, "/", kMarker);
    absl::StatusOr<std::unique_ptr<ReadableFile>> f = store_->NewReadableFile(marker);
    if (absl::IsNotFound(f.status())) {
      absl::StatusOr<std::vector<StoreEnv::Entry>> entries = store_->List(dir);
      if (entries.ok() && entries->empty()) return WriteMarker(uid);  // dosd stopped before it
      why = absl::StrCat("has no marker ", kMarker, " (dosd writes one naming the uid into "
                         "every owner's folder it makes)");
    } else if (!f.ok()) {
      why = absl::StrCat("has a marker dosd cannot read (", f.status().message(), ")");
    } else {
      char buf[32] = {};
      absl::StatusOr<size_t> n = (*f)->Read(buf, sizeof buf - 1);
      uint32_t named = 0;
      if (!n.ok() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, *n)),
                                       &named)) {
        why = absl::StrCat("has a marker ", kMarker, " that names no uid");
      } else if (named != uid) {
        why = absl::StrCat("was made for uid ", named, " (its marker ", kMarker,
                           " says so): it was renamed from ", kPrefix, named);
      }
    }
  }
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint folder ", dir, " ", why, "; it is not the folder dosd made for uid ", uid,
      ", so dosd neither restores from it nor writes to it: an operator should move it out of ",
      store_->root(), " (dosd then makes a fresh one for uid ", uid, ")"));
}

void UserFolders::Walk(const std::string& dir, int depth, std::vector<File>* out) const {
  absl::StatusOr<std::vector<StoreEnv::Entry>> entries = store_->List(dir);
  if (!entries.ok()) return;
  for (const StoreEnv::Entry& e : *entries) {
    const std::string path = absl::StrCat(dir, "/", e.name);
    if (e.kind == StoreEnv::Kind::kDirectory && depth < kMaxDepth) {
      Walk(path, depth + 1, out);
    } else if (e.kind == StoreEnv::Kind::kFile && !(depth == 0 && e.name == kMarker)) {
      absl::StatusOr<StoreEnv::Info> info = store_->Stat(path);
      if (info.ok() && info->kind == StoreEnv::Kind::kFile) {
        out->push_back({path, info->bytes, info->modified_ns});
      }
    }
  }
}

void UserFolders::Keep(uint32_t uid, const CheckpointUsage& usage) {
  {
    absl::MutexLock lock(&mu_);
    usage_[uid] = usage;
  }
  if (options_.on_usage) options_.on_usage(uid, usage);
}

CheckpointUsage UserFolders::Measure(uint32_t uid) {
  std::vector<File> files;
  Walk(Dir(uid), 0, &files);
  CheckpointUsage u;
  for (const File& f : files) {
    u.bytes += f.bytes;
    ++u.files;
  }
  Keep(uid, u);
  return u;
}

std::map<uint32_t, CheckpointUsage> UserFolders::Usage() const {
  absl::MutexLock lock(&mu_);
  return usage_;
}

absl::Status UserFolders::MakeRoom(uint32_t uid, uint64_t need, const std::string& path) {
  const uint64_t quota = options_.quota_bytes;
  if (quota == 0) return absl::OkStatus();
  const std::string replaced = Normal(path);
  std::vector<File> files;
  Walk(Dir(uid), 0, &files);
  // Every file under the folder is a checkpoint (or a temporary of one: only
  // this thread writes there, so none is being written now).
  uint64_t used = 0;
  const File* newest = nullptr;
  for (const File& f : files) {
    if (newest == nullptr || f.modified_ns > newest->modified_ns) newest = &f;
    if (f.path != replaced) used += f.bytes;
  }
  if (used + need <= quota) return absl::OkStatus();
  // Prunable: all but the newest and the one this save replaces, oldest
  // first; nothing goes unless that makes room.
  std::vector<File> prunable;
  uint64_t prunable_bytes = 0;
  for (const File& f : files) {
    if (&f == newest || f.path == replaced) continue;
    prunable.push_back(f);
    prunable_bytes += f.bytes;
  }
  if (options_.prune && used - prunable_bytes + need <= quota) {
    std::sort(prunable.begin(), prunable.end(), [](const File& a, const File& b) {
      return std::tie(a.modified_ns, a.path) < std::tie(b.modified_ns, b.path);
    });
    for (const File& f : prunable) {
      if (used + need <= quota) break;
      if (absl::Status st = store_->DeleteFile(f.path); !st.ok()) {
        DOS_LOG_WARNING("checkpoint.prune_failed", "path", f.path, "error", st.message());
        continue;
      }
      used -= f.bytes;
      DOS_LOG_INFO("checkpoint.pruned", "uid", uid, "path", f.path, "bytes", f.bytes, "reason",
                   "checkpoint_quota");
    }
    Measure(uid);
    if (used + need <= quota) return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "checkpoint: uid ", uid, "'s checkpoints use ", used, " bytes under ", Dir(uid),
      " and this save needs ", need, " more; the quota is ", quota,
      " bytes per uid (--checkpoint_quota)",
      options_.prune ? "; deleting every older checkpoint of this uid would not make room (the "
                       "newest is always kept), so none was deleted"
                     : "",
      ": delete checkpoints no longer needed (dosctl checkpoint delete PATH, or the "
      "DeleteCheckpoint call), save a smaller state, or ask an operator to raise "
      "--checkpoint_quota"));
}

void UserFolders::RemoveEmptyFolders(uint32_t uid, const std::string& dir) {
  const fs::path top = fs::path(Dir(uid)).lexically_normal();
  fs::path d = fs::path(Normal(dir)).lexically_normal();
  // Only strictly below uid's folder; DeleteDir refuses a folder with anything in it.
  for (int depth = 0; depth <= kMaxDepth && d != top && d.has_relative_path() &&
                      absl::StartsWith(d.string(), top.string() + "/");
       ++depth, d = d.parent_path()) {
    if (!store_->DeleteDir(d.string()).ok()) return;
  }
}

absl::StatusOr<UserFolders::Deleted> UserFolders::Delete(uint32_t uid, const std::string& path) {
  DOS_RETURN_IF_ERROR(Trust(uid, false));
  const std::string target = Normal(path);
  DOS_ASSIGN_OR_RETURN(StoreEnv::Info info, store_->Stat(target));
  Deleted out;
  if (info.kind == StoreEnv::Kind::kMissing) {
    return absl::NotFoundError(absl::StrCat(
        "checkpoint delete: ", target, " does not exist in uid ", uid,
        "'s folder; give a path relative to it (dosctl checkpoint save answers them)"));
  }
  if (info.kind == StoreEnv::Kind::kDirectory) {
    RemoveTree(*store_, target, 0, &out);
  } else if (info.kind == StoreEnv::Kind::kFile &&
             fs::path(target).filename() != kMarker) {
    DOS_RETURN_IF_ERROR(store_->DeleteFile(target));
    out.paths.push_back(target);
    out.bytes = info.bytes;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint delete: ", target, " is neither a checkpoint file nor a folder of them; "
        "name a file or folder dosd saved"));
  }
  RemoveEmptyFolders(uid, info.kind == StoreEnv::Kind::kDirectory
                              ? target
                              : fs::path(target).parent_path().string());
  const CheckpointUsage now = Measure(uid);
  DOS_LOG_INFO("checkpoint.deleted", "uid", uid, "path", target, "files", out.paths.size(), "bytes",
               out.bytes, "uid_bytes", now.bytes, "failed", out.failed);
  if (out.failed > 0) {
    // Not a success: the caller's files are still there (a read-only store).
    return absl::Status(out.first_error.code(),
                        absl::StrCat("checkpoint delete: ", out.failed, " file(s) under ", target,
                                     " could not be deleted (first: ", out.first_error.message(),
                                     "); ", out.paths.size(), " deleted (", out.bytes, " bytes)"));
  }
  return out;
}

}  // namespace dos
