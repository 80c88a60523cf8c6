#include "daemon/checkpoint/env.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace dos {
namespace {

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::StatusOr<size_t> Write(const char* data, size_t n) override {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("write to closed ", path_));
    while (true) {
      ssize_t w = ::write(fd_, data, n);
      if (w >= 0) return static_cast<size_t>(w);
      if (errno != EINTR) return ErrnoToStatus(errno, "write", path_);
    }
  }

  absl::Status Sync() override {
    if (::fsync(fd_) != 0) return ErrnoToStatus(errno, "fsync", path_);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    if (fd_ < 0) return absl::OkStatus();
    int rc = ::close(fd_);
    fd_ = -1;
    // Linux closes the descriptor even when close(2) fails; EINTR is not a loss.
    if (rc != 0 && errno != EINTR) return ErrnoToStatus(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  int fd_;
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }

  absl::StatusOr<size_t> Read(char* buf, size_t n) override {
    while (true) {
      ssize_t r = ::read(fd_, buf, n);
      if (r >= 0) return static_cast<size_t>(r);
      if (errno != EINTR) return ErrnoToStatus(errno, "read", path_);
    }
  }
  uint64_t Size() const override { return size_; }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

class PosixEnv final : public Env {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint32_t mode) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0) return ErrnoToStatus(errno, "create", path);
    return WritableFileFromFd(path, fd);
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(errno, "open", path);
    return ReadableFileFromFd(path, fd);
  }

  bool FileExists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }

  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return ErrnoToStatus(errno, "opendir", dir);
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
    ::closedir(d);
    return names;
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("rename ", from, " to"), to);
    }
    return absl::OkStatus();
  }

  absl::Status DeleteFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoToStatus(errno, "unlink", path);
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(errno, "open directory", dir);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoToStatus(err, "fsync directory", dir);
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> FreeBytes(const std::string& dir) override {
    struct statvfs vfs;
    if (::statvfs(dir.c_str(), &vfs) != 0) return ErrnoToStatus(errno, "statvfs", dir);
    return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
};

}  // namespace

std::unique_ptr<WritableFile> WritableFileFromFd(std::string path, int fd) {
  return std::make_unique<PosixWritableFile>(std::move(path), fd);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> ReadableFileFromFd(std::string path, int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  return std::make_unique<PosixReadableFile>(std::move(path), fd,
                                             static_cast<uint64_t>(st.st_size));
}

Env* Env::Default() {
  static Env* const env = new PosixEnv();
  return env;
}

std::string DirName(absl::string_view path) {
  size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::Status ErrnoToStatus(int err, absl::string_view what, absl::string_view path) {
  const char* desc = ::strerrordesc_np(err);
  std::string msg = absl::StrCat(what, " ", path, ": ",
                                 desc != nullptr ? std::string(desc) : absl::StrCat("errno ", err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:  // the process's file size limit (RLIMIT_FSIZE)
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace dos
