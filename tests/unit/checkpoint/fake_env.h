// Test doubles for the checkpoint Env seam (daemon/checkpoint/env.h).
//
// FaultInjectionEnv wraps another Env (usually Env::Default() over a temporary
// directory, so what survives a fault is checked on a real file system) and
// injects the faults a disk gives: ENOSPC after N bytes (the write that
// crosses the limit is short, the next fails, as write(2) does), short writes,
// writes that make no progress, and failures of fsync, close, rename, the
// directory fsync and reads. It counts what was done so tests can check, for
// example, that the directory was fsynced after the rename.
//
// MemEnv keeps files in memory (for the fuzzer and fast tests).
//
// Thread-safety: both are thread-safe.
#pragma once

#include <cerrno>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/checkpoint/env.h"

namespace dos::testing {

class FaultInjectionEnv : public Env {
 public:
  explicit FaultInjectionEnv(Env* base) : base_(base) {}

  // Writes beyond `bytes` in total (across all files written from now) fail
  // with `err` (ENOSPC by default).
  void FailWritesAfter(uint64_t bytes, int err = ENOSPC);
  // Every write accepts at most `n` bytes.
  void LimitWriteSize(size_t n);
  // Writes return 0 bytes (a file system making no progress).
  void StallWrites();
  void FailSync(int err = EIO);
  void FailClose(int err = EIO);
  void FailRename(int err = EXDEV);
  void FailSyncDir(int err = EIO);
  // Reads beyond `bytes` (per file) fail with `err`.
  void FailReadsAfter(uint64_t bytes, int err = EIO);
  // What FreeBytes reports instead of the real figure.
  void ReportFreeBytes(uint64_t bytes);
  void ClearFaults();

  uint64_t bytes_written() const;
  int syncs() const;
  int dir_syncs() const;
  int renames() const;
  int writes() const;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint32_t mode) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  bool FileExists(const std::string& path) override { return base_->FileExists(path); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    return base_->GetChildren(dir);
  }
  absl::Status RenameFile(const std::string& from, const std::string& to) override;
  absl::Status DeleteFile(const std::string& path) override { return base_->DeleteFile(path); }
  absl::Status SyncDir(const std::string& dir) override;
  absl::StatusOr<uint64_t> FreeBytes(const std::string& dir) override;

 private:
  friend class FaultyWritableFile;
  friend class FaultyReadableFile;
  // Returns how many of `n` bytes the next write may take, or an errno.
  absl::StatusOr<size_t> AdmitWrite(const std::string& path, size_t n);
  void Wrote(size_t n);

  Env* const base_;
  mutable absl::Mutex mu_;
  std::optional<uint64_t> write_limit_ ABSL_GUARDED_BY(mu_);
  int write_err_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_write_ ABSL_GUARDED_BY(mu_) = 0;
  bool stall_ ABSL_GUARDED_BY(mu_) = false;
  int sync_err_ ABSL_GUARDED_BY(mu_) = 0;
  int close_err_ ABSL_GUARDED_BY(mu_) = 0;
  int rename_err_ ABSL_GUARDED_BY(mu_) = 0;
  int sync_dir_err_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<uint64_t> read_limit_ ABSL_GUARDED_BY(mu_);
  int read_err_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<uint64_t> free_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_written_ ABSL_GUARDED_BY(mu_) = 0;
  int syncs_ ABSL_GUARDED_BY(mu_) = 0;
  int dir_syncs_ ABSL_GUARDED_BY(mu_) = 0;
  int renames_ ABSL_GUARDED_BY(mu_) = 0;
  int writes_ ABSL_GUARDED_BY(mu_) = 0;
};

class MemEnv : public Env {
 public:
  // Sets or reads a file's whole contents.
  void Put(const std::string& path, std::string contents);
  std::optional<std::string> Get(const std::string& path) const;
  std::vector<std::string> Files() const;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint32_t mode) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  bool FileExists(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override;
  absl::Status RenameFile(const std::string& from, const std::string& to) override;
  absl::Status DeleteFile(const std::string& path) override;
  absl::Status SyncDir(const std::string&) override { return absl::OkStatus(); }
  absl::StatusOr<uint64_t> FreeBytes(const std::string&) override { return uint64_t{1} << 40; }

 private:
  friend class MemWritableFile;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> files_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dos::testing
