// Env: the file-system seam of the checkpoint code. Every byte a checkpoint
// reads or writes, every fsync, rename and free-space query goes through an
// Env, so tests can inject disk faults (ENOSPC at byte N, short writes, fsync
// or rename failures) the way LevelDB's SpecialEnv does, and the fuzzer can
// read from memory.
//
// Env::Default() is the POSIX implementation; it lives for the whole process.
// Errors come back as absl::Status with the path and strerror in the message
// and a canonical code: ENOSPC/EDQUOT/EFBIG -> RESOURCE_EXHAUSTED, ENOENT ->
// NOT_FOUND, EACCES/EPERM/EROFS -> PERMISSION_DENIED, others -> INTERNAL.
//
// Thread-safety: an Env is thread-safe; a file object is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dos {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Appends up to `n` bytes of `data` and returns how many were written,
  // which may be fewer than `n` (as write(2) may); callers loop. A return of
  // 0 for n > 0 is a failure of the file system to make progress.
  virtual absl::StatusOr<size_t> Write(const char* data, size_t n) = 0;
  // Makes the written bytes durable (fsync).
  virtual absl::Status Sync() = 0;
  // Closes the file; later calls fail. Close errors are real (NFS reports
  // write-back failures here), so callers check them.
  virtual absl::Status Close() = 0;
};

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads up to `n` bytes at the current position; returns how many, 0 at the
  // end of the file.
  virtual absl::StatusOr<size_t> Read(char* buf, size_t n) = 0;
  // The file's size when it was opened.
  virtual uint64_t Size() const = 0;
};

class Env {
 public:
  virtual ~Env() = default;
  // The process-wide POSIX Env.
  static Env* Default();

  // Creates `path` for writing with permissions `mode` (before the umask).
  // The file must not exist (ALREADY_EXISTS otherwise) and a symlink at
  // `path` is never followed (O_CREAT|O_EXCL|O_NOFOLLOW).
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                        uint32_t mode) = 0;
  // Opens a regular file for reading; a symlink at `path` is not followed.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(
      const std::string& path) = 0;
  virtual bool FileExists(const std::string& path) = 0;
  // Names (not paths) of the entries in `dir`, without "." and "..".
  virtual absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) = 0;
  // Atomically replaces `to` with `from` (rename(2): both in one directory).
  virtual absl::Status RenameFile(const std::string& from, const std::string& to) = 0;
  virtual absl::Status DeleteFile(const std::string& path) = 0;
  // fsyncs the directory itself, making a rename or creation in it durable.
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  // Bytes available to this (unprivileged) process on the file system of
  // `dir` (statvfs f_bavail * f_frsize).
  virtual absl::StatusOr<uint64_t> FreeBytes(const std::string& dir) = 0;
};

// For Env implementations: file objects over an open descriptor (owned from
// here; closed on failure too). ReadableFileFromFd refuses anything but a
// regular file (FAILED_PRECONDITION naming `path`).
std::unique_ptr<WritableFile> WritableFileFromFd(std::string path, int fd);
absl::StatusOr<std::unique_ptr<ReadableFile>> ReadableFileFromFd(std::string path, int fd);

// The directory part of `path` ("." when it has none).
std::string DirName(absl::string_view path);
// Maps errno `err` to a canonical Status: "<what> <path>: <strerror>".
absl::Status ErrnoToStatus(int err, absl::string_view what, absl::string_view path);

}  // namespace dos
