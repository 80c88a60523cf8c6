// UserFolders: the checkpoint store's per-owner folders, <root>/uid-<uid>/:
// whether dosd trusts one, what each holds, what it may hold
// (--checkpoint_quota) and deleting from it.
//
// Trust. dosd writes and restores only through a folder it made for that uid:
// owned by dosd's uid, no access for group or others (0700), and holding the
// marker file `.dos-owner` that dosd wrote there naming the uid when it made
// the folder. A folder someone else made, or one renamed from another uid's
// (its marker names that uid), is not trusted: restore scans skip it (logged
// once, checkpoint.folder_untrusted) and saves, loads and deletes in it fail
// with FAILED_PRECONDITION naming the folder, what is wrong and the fix. An
// empty folder without a marker (dosd stopped between mkdir and marker) is
// adopted.
//
// Quota. Every regular file under a uid's folder (its checkpoints, explicit
// and autosaved, whatever their names; not the marker) counts toward its
// usage. With a quota, a save of N bytes first makes room: with `prune`, the
// uid's oldest files (by modification time) are deleted until the save fits,
// never the uid's newest one (a failed save still leaves it), never the file
// the save replaces, and none at all when deleting every other would not make
// room; without `prune`, or then, the save is refused with RESOURCE_EXHAUSTED
// naming the usage, the quota, the flag and the fix.
//
// Usage is measured by walking the folder (through StoreEnv, never a link)
// after every change dosd makes and at Start; the last measures are kept for
// GetStats and metrics (on_usage).
//
// Thread-safety: MakeRoom/Measure/Delete from the checkpointer's writer thread
// only (they change the folders, as saves do); Trust, Usage() and quota() from
// any thread (Trust writes only a missing marker, exclusively).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/checkpoint/store_env.h"

namespace dos {

// The folder (within a uid's) of one job's checkpoints, from its free-text
// client name: [A-Za-z0-9._-] as they are, any other byte (and a leading
// '.') as %XX, "%" for an empty name; over 128 characters, the first 100,
// '~' and 16 hex digits of a hash of the whole name. Distinct names get
// distinct folders (they once shared one: "exp/1" and "exp_1" saved to the
// same file, and one job's checkpoint replaced the other's).
std::string JobFolderName(std::string_view client_name);
// "<JobFolderName>.r<rank>": one rank's part of a checkpoint's name (its
// folder under the uid's, or the file's name in a folder the caller gave).
std::string RankName(std::string_view client_name, int32_t rank);

struct CheckpointUsage {
  uint64_t bytes = 0;
  uint64_t files = 0;
};

struct UserFoldersOptions {
  uint64_t quota_bytes = 0;  // per uid; 0: none (--checkpoint_quota)
  bool prune = true;         // over the quota: delete the oldest (--checkpoint_quota_prune)
  // Told each new measure of a uid's usage (metrics); on the writer thread.
  std::function<void(uint32_t uid, const CheckpointUsage&)> on_usage;
};

class UserFolders {
 public:
  static constexpr char kMarker[] = ".dos-owner";

  // `store` must outlive this.
  UserFolders(StoreEnv* store, UserFoldersOptions options)
      : store_(store), options_(std::move(options)) {}

  // <root>/uid-<uid>.
  std::string Dir(uint32_t uid) const;
  // "uid-<n>" -> n.
  static bool ParseName(const std::string& name, uint32_t* uid);

  // OK when uid's folder is dosd's for that uid (see above). `create`: a
  // missing folder is made (0700, with its marker); else missing is OK.
  absl::Status Trust(uint32_t uid, bool create);

  // Before a save of `need` bytes to `path` (under uid's folder; the file
  // there, if any, is replaced and does not count).
  absl::Status MakeRoom(uint32_t uid, uint64_t need, const std::string& path);

  // Walks uid's folder, keeps and reports the result.
  CheckpointUsage Measure(uint32_t uid);

  struct Deleted {
    std::vector<std::string> paths;
    uint64_t bytes = 0;
    int failed = 0;            // files of a folder that could not be deleted
    absl::Status first_error;  // the first of them
  };
  // Deletes `path` (resolved, under uid's folder): a checkpoint file, or
  // every regular file under a folder and then its emptied folders. Never the
  // marker or uid's folder itself.
  absl::StatusOr<Deleted> Delete(uint32_t uid, const std::string& path);
  // Removes `dir` (under uid's folder) and each folder above it that is left
  // empty, up to uid's folder (kept): a delete or a failed save leaves no
  // empty folders, which the quota (file bytes) would not count.
  void RemoveEmptyFolders(uint32_t uid, const std::string& dir);

  // The last measure of every uid measured so far.
  std::map<uint32_t, CheckpointUsage> Usage() const;
  uint64_t quota() const { return options_.quota_bytes; }

 private:
  struct File {
    std::string path;
    uint64_t bytes = 0;
    int64_t modified_ns = 0;
  };
  // Every regular file under `dir` but the marker (depth-limited).
  void Walk(const std::string& dir, int depth, std::vector<File>* out) const;
  void Keep(uint32_t uid, const CheckpointUsage& usage);
  absl::Status WriteMarker(uint32_t uid);

  StoreEnv* const store_;
  const UserFoldersOptions options_;
  mutable absl::Mutex mu_;
  std::map<uint32_t, CheckpointUsage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dos
