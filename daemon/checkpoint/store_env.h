// StoreEnv: the checkpoint store's file system, reached only through one
// open directory descriptor.
//
// Open() creates the store's folder if missing (mode 0700) and opens it with
// O_DIRECTORY|O_CLOEXEC; that is the only path dosd ever resolves by name
// (the operator's --checkpoint_dir, which may itself be a link to another
// disk). Every other path must lie under it ("<root>/uid-1000/job.r0/x"):
// its folders are opened one at a time from the root's descriptor with
// openat(O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC) (created with mkdirat where
// asked), and the file operation is made relative to the last one
// (openat with O_NOFOLLOW, and O_CREAT|O_EXCL for new files; renameat,
// unlinkat, fstatat with AT_SYMLINK_NOFOLLOW, fdopendir, fstatvfs, fsync).
// So a folder swapped for a symlink, at any time, makes the operation fail
// (INVALID_ARGUMENT naming the link and the fix) instead of redirecting dosd
// out of its store; nothing is followed, and `..` is refused.
//
// The root must be dosd's alone: Open() refuses (PERMISSION_DENIED naming the
// path and the fix) a root owned by another uid (its owner could swap the
// owners' folders inside), one whose mode cannot be set to 0700, and one in a
// folder that every user may write without the sticky bit (anyone could
// rename the root away and put their own in its place before a restart).
//
// Thread-safety: thread-safe (the root descriptor is only read).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/checkpoint/env.h"
#include "dos/wire/unique_fd.h"

namespace dos {

class StoreEnv final : public Env {
 public:
  // FAILED_PRECONDITION naming `root` and the fix when it cannot be created
  // or opened as a directory; PERMISSION_DENIED (see above) when it is not
  // dosd's alone.
  static absl::StatusOr<std::unique_ptr<StoreEnv>> Open(const std::string& root);

  // The store's folder, lexically normal ("/var/lib/dos/checkpoints").
  const std::string& root() const { return root_; }
  // OK when dosd may create folders and files in the store's folder (the
  // per-uid folders of every save); otherwise PERMISSION_DENIED naming the
  // folder, its owner and mode, the user dosd runs as and the fix. A store
  // dosd cannot write still restores; saves fail.
  absl::Status CheckWritable() const;

  // Env. Paths outside the root are INVALID_ARGUMENT.
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint32_t mode) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  bool FileExists(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override;
  // Both in one folder (the writer's temporary and its destination).
  absl::Status RenameFile(const std::string& from, const std::string& to) override;
  absl::Status DeleteFile(const std::string& path) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::StatusOr<uint64_t> FreeBytes(const std::string& dir) override;

  // What is at a path, not following a link there.
  enum class Kind { kMissing, kFile, kDirectory, kOther };  // kOther: a link, socket...
  // kMissing also when a folder on the way is missing; errors for a link on
  // the way.
  absl::StatusOr<Kind> KindOf(const std::string& path);
  absl::StatusOr<uint64_t> FileSize(const std::string& path);
  // What fstatat (not following a link) says of a path.
  struct Info {
    Kind kind = Kind::kMissing;
    uint64_t bytes = 0;
    uid_t owner = 0;
    mode_t mode = 0;               // permission bits only
    int64_t modified_ns = 0;       // st_mtim
  };
  absl::StatusOr<Info> Stat(const std::string& path);
  // Removes the empty folder `dir` (below the root).
  absl::Status DeleteDir(const std::string& dir);
  // The missing folders of `dir` (below the root) are created with `mode`.
  absl::Status CreateDirs(const std::string& dir, mode_t mode);

  struct Entry {
    std::string name;
    Kind kind;
  };
  // The entries of folder `dir` (no "." and ".."), each with its kind.
  absl::StatusOr<std::vector<Entry>> List(const std::string& dir);

 private:
  StoreEnv(std::string root, UniqueFd fd) : root_(std::move(root)), root_fd_(std::move(fd)) {}
  // `path`'s components below the root; INVALID_ARGUMENT outside it or with "..".
  absl::StatusOr<std::vector<std::string>> Split(const std::string& path) const;
  // Opens the folder made of parts[0, n) (the root for n = 0);
  // `create`: missing ones are made with `mode`.
  absl::StatusOr<UniqueFd> OpenDir(const std::vector<std::string>& parts, size_t n, bool create,
                                   mode_t mode) const;
  struct Leaf {
    UniqueFd dir;      // the folder holding it
    std::string name;  // "" for the root itself
  };
  absl::StatusOr<Leaf> OpenParent(const std::string& path) const;
  // The error for `name` in the folder made of parts[0, n) that openat
  // refused with `err`: a link or non-folder is INVALID_ARGUMENT with the fix.
  absl::Status Refused(int dir_fd, const std::vector<std::string>& parts, size_t n, int err,
                       absl::string_view what) const;
  std::string Join(const std::vector<std::string>& parts, size_t n) const;
  // ErrnoToStatus for a write (`what` at `path`) that failed with `err`,
  // plus the fix when dosd lacks the right (EACCES, EPERM, EROFS).
  absl::Status WriteFailed(int err, absl::string_view what, const std::string& path) const;

  const std::string root_;
  const UniqueFd root_fd_;
};

}  // namespace dos
