#include "daemon/checkpoint/store_env.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

namespace fs = std::filesystem;

constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

std::string Normal(const std::string& path) {
  std::string n = fs::path(path).lexically_normal().string();
  while (n.size() > 1 && n.back() == '/') n.pop_back();
  return n;
}

StoreEnv::Kind KindOfMode(mode_t m) {
  if (S_ISREG(m)) return StoreEnv::Kind::kFile;
  if (S_ISDIR(m)) return StoreEnv::Kind::kDirectory;
  return StoreEnv::Kind::kOther;
}

// The store is dosd's alone: trainers reach their state only through dosd,
// and whoever may write the root (or rename it) could hand one user's
// folder to another. `fd` is the opened root.
absl::Status CheckOwnRoot(const std::string& root, int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat", root);
  const uid_t me = ::geteuid();
  if (st.st_uid != me) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--checkpoint_dir=", root, " is owned by uid ", st.st_uid, ", not by dosd's uid ", me,
        ": its owner could swap the owners' uid-<uid> folders in it and hand one user's state "
        "to another; dosd does not start on it. chown ", me, " ", root,
        " (and chmod 0700), or give --checkpoint_dir a folder dosd creates"));
  }
  const int chmod_rc = ::fchmod(fd, 0700);
  const int chmod_err = errno;
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat", root);
  if (chmod_rc != 0 && chmod_err == EROFS && (st.st_mode & 077) == 0) {
    // Already dosd's alone on a file system mounted (or remounted after
    // errors) read-only: its checkpoints still restore; saves fail, naming it.
    DOS_LOG_WARNING("checkpoint.store_read_only", "path", root, "note",
                    "the store's file system is read-only: checkpoints in it restore, saves "
                    "fail until it is writable again");
  } else if (chmod_rc != 0 || (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--checkpoint_dir=", root, " cannot be made dosd's alone (chmod 0700: ",
        chmod_rc != 0 ? std::strerror(chmod_err) : "done",
        absl::StrFormat("; mode now %04o", st.st_mode & 07777),
        "); dosd does not start on a store others can write: fix its owner, mode and ACLs, or "
        "give --checkpoint_dir another folder"));
  }
  // The folder holding the root (as opened: the operator's link followed).
  char self[64];
  std::snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
  std::error_code ec;
  const fs::path real = fs::read_symlink(self, ec);
  struct stat parent;
  if (!ec && real.has_parent_path() && ::stat(real.parent_path().c_str(), &parent) == 0 &&
      (parent.st_mode & S_IWOTH) != 0 && (parent.st_mode & S_ISVTX) == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--checkpoint_dir=", root, " lies in ", real.parent_path().string(),
        absl::StrFormat(", which every user may write (mode %04o", parent.st_mode & 07777),
        ", no sticky bit): anyone could rename the store away and put their own in its "
        "place; dosd does not start on it. Move the store (e.g. /var/lib/dos/checkpoints) or "
        "chmod o-w (or +t) that folder"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StoreEnv>> StoreEnv::Open(const std::string& root) {
  const std::string r = Normal(root);
  if (r.empty() || r == ".") {
    return absl::InvalidArgumentError(
        "the checkpoint store needs a folder; give --checkpoint_dir a path (empty: off)");
  }
  std::error_code ec;
  fs::create_directories(r, ec);
  UniqueFd fd(::open(r.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint_dir=", root, " is not a directory and cannot be created (",
        ec ? ec.message() : std::string(std::strerror(errno)),
        "); create it writable by the daemon's user"));
  }
  DOS_RETURN_IF_ERROR(CheckOwnRoot(root, fd.get()));
  return std::unique_ptr<StoreEnv>(new StoreEnv(r, std::move(fd)));
}

absl::Status StoreEnv::CheckWritable() const {
  if (::faccessat(root_fd_.get(), ".", W_OK | X_OK, AT_EACCESS) == 0) return absl::OkStatus();
  return WriteFailed(errno, "write in", root_);
}

absl::Status StoreEnv::WriteFailed(int err, absl::string_view what,
                                   const std::string& path) const {
  absl::Status st = ErrnoToStatus(err, what, path);
  if (err == EROFS) {
    return absl::Status(st.code(), absl::StrCat(st.message(), "; the checkpoint folder ", root_,
                                                " is on a read-only file system: point "
                                                "--checkpoint_dir at a writable one"));
  }
  if (err != EACCES && err != EPERM) return st;
  struct stat root;
  std::string owner;
  if (::fstat(root_fd_.get(), &root) == 0) {
    owner = absl::StrFormat(" (owner uid %u, group gid %u, mode %04o)", root.st_uid, root.st_gid,
                            root.st_mode & 07777);
  }
  // dosd's user by name where it has one (chown takes either).
  std::string user = absl::StrCat(::geteuid());
  struct passwd pw;
  struct passwd* found = nullptr;
  char buf[4096];
  if (::getpwuid_r(::geteuid(), &pw, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    user = found->pw_name;
  }
  return absl::Status(
      st.code(), absl::StrCat(st.message(), "; dosd runs as ", user, " (uid ", ::geteuid(),
                              "), which may not write in its checkpoint folder ", root_, owner,
                              ": give it the folder (sudo chown -R ", user, " ", root_,
                              ") or point --checkpoint_dir at a folder it can write"));
}

std::string StoreEnv::Join(const std::vector<std::string>& parts, size_t n) const {
  std::string out = root_;
  for (size_t i = 0; i < n; ++i) absl::StrAppend(&out, out == "/" ? "" : "/", parts[i]);
  return out;
}

absl::StatusOr<std::vector<std::string>> StoreEnv::Split(const std::string& path) const {
  const std::string n = Normal(path);
  if (n == root_) return std::vector<std::string>{};
  const std::string prefix = root_ == "/" ? "/" : root_ + "/";
  std::vector<std::string> parts;
  if (absl::StartsWith(n, prefix)) {
    for (absl::string_view p : absl::StrSplit(n.substr(prefix.size()), '/', absl::SkipEmpty())) {
      parts.emplace_back(p);
    }
  }
  bool bad = parts.empty();
  for (const std::string& p : parts) bad |= p == ".." || p == ".";
  if (bad) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is outside dosd's checkpoint store ", root_,
        "; give a path inside it (relative to the session owner's folder)"));
  }
  return parts;
}

absl::Status StoreEnv::Refused(int dir_fd, const std::vector<std::string>& parts, size_t n,
                               int err, absl::string_view what) const {
  const std::string path = Join(parts, n);
  if (err == ELOOP || err == ENOTDIR) {
    struct stat st;
    const bool link = ::fstatat(dir_fd, parts[n - 1].c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                      S_ISLNK(st.st_mode);
    return absl::InvalidArgumentError(absl::StrCat(
        path, link ? " is a symlink" : " is not a folder",
        "; dosd does not follow links in its checkpoint store ", root_,
        " and made nothing there: remove ", path,
        link ? " (dosd recreates its own folders)" : "", " or name another path"));
  }
  return ErrnoToStatus(err, what, path);
}

absl::StatusOr<UniqueFd> StoreEnv::OpenDir(const std::vector<std::string>& parts, size_t n,
                                           bool create, mode_t mode) const {
  // A new open file description of the root (not a dup, which would share
  // the directory offset that fdopendir/readdir advance).
  UniqueFd cur(::openat(root_fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!cur.valid()) return ErrnoToStatus(errno, "open", root_);
  for (size_t i = 0; i < n; ++i) {
    const char* name = parts[i].c_str();
    int fd = ::openat(cur.get(), name, kDirFlags);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(cur.get(), name, mode) != 0 && errno != EEXIST) {
        return WriteFailed(errno, "mkdir", Join(parts, i + 1));
      }
      fd = ::openat(cur.get(), name, kDirFlags);
    }
    if (fd < 0) return Refused(cur.get(), parts, i + 1, errno, "open folder");
    cur.reset(fd);
  }
  return cur;
}

absl::StatusOr<StoreEnv::Leaf> StoreEnv::OpenParent(const std::string& path) const {
  absl::StatusOr<std::vector<std::string>> parts = Split(path);
  if (!parts.ok()) return parts.status();
  if (parts->empty()) {
    absl::StatusOr<UniqueFd> root = OpenDir(*parts, 0, false, 0);
    if (!root.ok()) return root.status();
    return Leaf{*std::move(root), ""};
  }
  absl::StatusOr<UniqueFd> dir = OpenDir(*parts, parts->size() - 1, false, 0);
  if (!dir.ok()) return dir.status();
  return Leaf{*std::move(dir), parts->back()};
}

absl::StatusOr<std::unique_ptr<WritableFile>> StoreEnv::NewWritableFile(const std::string& path,
                                                                        uint32_t mode) {
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  if (!leaf.ok()) return leaf.status();
  if (leaf->name.empty()) return ErrnoToStatus(EISDIR, "create", path);
  int fd = ::openat(leaf->dir.get(), leaf->name.c_str(),
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return WriteFailed(errno, "create", path);  // EEXIST for a planted link too
  return WritableFileFromFd(path, fd);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> StoreEnv::NewReadableFile(const std::string& path) {
  absl::StatusOr<std::vector<std::string>> parts = Split(path);
  if (!parts.ok()) return parts.status();
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  if (!leaf.ok()) return leaf.status();
  if (leaf->name.empty()) return ErrnoToStatus(EISDIR, "open", path);
  // O_NONBLOCK: a FIFO there must not hang dosd (ReadableFileFromFd refuses it).
  int fd = ::openat(leaf->dir.get(), leaf->name.c_str(),
                    O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Refused(leaf->dir.get(), *parts, parts->size(), errno, "open");
  return ReadableFileFromFd(path, fd);
}

bool StoreEnv::FileExists(const std::string& path) {
  absl::StatusOr<Kind> k = KindOf(path);
  return k.ok() && *k != Kind::kMissing;
}

absl::StatusOr<StoreEnv::Kind> StoreEnv::KindOf(const std::string& path) {
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  if (absl::IsNotFound(leaf.status())) return Kind::kMissing;
  if (!leaf.ok()) return leaf.status();
  if (leaf->name.empty()) return Kind::kDirectory;
  struct stat st;
  if (::fstatat(leaf->dir.get(), leaf->name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return Kind::kMissing;
    return ErrnoToStatus(errno, "stat", path);
  }
  return KindOfMode(st.st_mode);
}

absl::StatusOr<uint64_t> StoreEnv::FileSize(const std::string& path) {
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  if (!leaf.ok()) return leaf.status();
  struct stat st;
  if (leaf->name.empty() ||
      ::fstatat(leaf->dir.get(), leaf->name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoToStatus(leaf->name.empty() ? EISDIR : errno, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<StoreEnv::Info> StoreEnv::Stat(const std::string& path) {
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  Info info;
  if (absl::IsNotFound(leaf.status())) return info;
  if (!leaf.ok()) return leaf.status();
  struct stat st;
  const int rc = leaf->name.empty() ? ::fstat(leaf->dir.get(), &st)
                                    : ::fstatat(leaf->dir.get(), leaf->name.c_str(), &st,
                                                AT_SYMLINK_NOFOLLOW);
  if (rc != 0) {
    if (errno == ENOENT) return info;
    return ErrnoToStatus(errno, "stat", path);
  }
  info.kind = KindOfMode(st.st_mode);
  info.bytes = static_cast<uint64_t>(st.st_size);
  info.owner = st.st_uid;
  info.mode = st.st_mode & 07777;
  info.modified_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  return info;
}

absl::Status StoreEnv::DeleteDir(const std::string& dir) {
  absl::StatusOr<Leaf> leaf = OpenParent(dir);
  if (!leaf.ok()) return leaf.status();
  if (leaf->name.empty() || ::unlinkat(leaf->dir.get(), leaf->name.c_str(), AT_REMOVEDIR) != 0) {
    return ErrnoToStatus(leaf->name.empty() ? EBUSY : errno, "rmdir", dir);
  }
  return absl::OkStatus();
}

absl::Status StoreEnv::CreateDirs(const std::string& dir, mode_t mode) {
  absl::StatusOr<std::vector<std::string>> parts = Split(dir);
  if (!parts.ok()) return parts.status();
  return OpenDir(*parts, parts->size(), true, mode).status();
}

absl::StatusOr<std::vector<std::string>> StoreEnv::GetChildren(const std::string& dir) {
  absl::StatusOr<std::vector<Entry>> entries = List(dir);
  if (!entries.ok()) return entries.status();
  std::vector<std::string> names;
  for (Entry& e : *entries) names.push_back(std::move(e.name));
  return names;
}

absl::StatusOr<std::vector<StoreEnv::Entry>> StoreEnv::List(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> parts = Split(dir);
  if (!parts.ok()) return parts.status();
  absl::StatusOr<UniqueFd> fd = OpenDir(*parts, parts->size(), false, 0);
  if (!fd.ok()) return fd.status();
  DIR* d = ::fdopendir(fd->get());
  if (d == nullptr) return ErrnoToStatus(errno, "opendir", dir);
  fd->release();  // closedir closes it
  std::vector<Entry> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    Kind kind = Kind::kOther;
    if (e->d_type == DT_REG) {
      kind = Kind::kFile;
    } else if (e->d_type == DT_DIR) {
      kind = Kind::kDirectory;
    } else if (e->d_type == DT_UNKNOWN) {
      struct stat st;
      if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      kind = KindOfMode(st.st_mode);
    }
    out.push_back({name, kind});
  }
  ::closedir(d);
  return out;
}

absl::Status StoreEnv::RenameFile(const std::string& from, const std::string& to) {
  absl::StatusOr<Leaf> a = OpenParent(from);
  if (!a.ok()) return a.status();
  absl::StatusOr<Leaf> b = OpenParent(to);
  if (!b.ok()) return b.status();
  if (a->name.empty() || b->name.empty() ||
      ::renameat(a->dir.get(), a->name.c_str(), b->dir.get(), b->name.c_str()) != 0) {
    return ErrnoToStatus(a->name.empty() || b->name.empty() ? EBUSY : errno,
                         absl::StrCat("rename ", from, " to"), to);
  }
  return absl::OkStatus();
}

absl::Status StoreEnv::DeleteFile(const std::string& path) {
  absl::StatusOr<Leaf> leaf = OpenParent(path);
  if (!leaf.ok()) return leaf.status();
  if (leaf->name.empty() || ::unlinkat(leaf->dir.get(), leaf->name.c_str(), 0) != 0) {
    return ErrnoToStatus(leaf->name.empty() ? EISDIR : errno, "unlink", path);
  }
  return absl::OkStatus();
}

absl::Status StoreEnv::SyncDir(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> parts = Split(dir);
  if (!parts.ok()) return parts.status();
  absl::StatusOr<UniqueFd> fd = OpenDir(*parts, parts->size(), false, 0);
  if (!fd.ok()) return fd.status();
  if (::fsync(fd->get()) != 0) return ErrnoToStatus(errno, "fsync directory", dir);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> StoreEnv::FreeBytes(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> parts = Split(dir);
  if (!parts.ok()) return parts.status();
  absl::StatusOr<UniqueFd> fd = OpenDir(*parts, parts->size(), false, 0);
  if (!fd.ok()) return fd.status();
  struct statvfs vfs;
  if (::fstatvfs(fd->get(), &vfs) != 0) return ErrnoToStatus(errno, "statvfs", dir);
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

}  // namespace dos
