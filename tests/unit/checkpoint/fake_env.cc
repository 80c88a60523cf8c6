#include "tests/unit/checkpoint/fake_env.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dos::testing {

class FaultyWritableFile final : public WritableFile {
 public:
  FaultyWritableFile(FaultInjectionEnv* env, std::string path, std::unique_ptr<WritableFile> base)
      : env_(env), path_(std::move(path)), base_(std::move(base)) {}

  absl::StatusOr<size_t> Write(const char* data, size_t n) override {
    absl::StatusOr<size_t> admit = env_->AdmitWrite(path_, n);
    if (!admit.ok()) return admit.status();
    if (*admit == 0) return size_t{0};
    absl::StatusOr<size_t> w = base_->Write(data, *admit);
    if (w.ok()) env_->Wrote(*w);
    return w;
  }
  absl::Status Sync() override {
    {
      absl::MutexLock l(&env_->mu_);
      ++env_->syncs_;
      if (env_->sync_err_ != 0) return ErrnoToStatus(env_->sync_err_, "fsync", path_);
    }
    return base_->Sync();
  }
  absl::Status Close() override {
    absl::Status s = base_->Close();
    absl::MutexLock l(&env_->mu_);
    if (env_->close_err_ != 0) return ErrnoToStatus(env_->close_err_, "close", path_);
    return s;
  }

 private:
  FaultInjectionEnv* const env_;
  const std::string path_;
  std::unique_ptr<WritableFile> base_;
};

class FaultyReadableFile final : public ReadableFile {
 public:
  FaultyReadableFile(FaultInjectionEnv* env, std::string path, std::unique_ptr<ReadableFile> base)
      : env_(env), path_(std::move(path)), base_(std::move(base)) {}

  absl::StatusOr<size_t> Read(char* buf, size_t n) override {
    {
      absl::MutexLock l(&env_->mu_);
      if (env_->read_limit_.has_value()) {
        if (pos_ >= *env_->read_limit_) return ErrnoToStatus(env_->read_err_, "read", path_);
        n = static_cast<size_t>(std::min<uint64_t>(n, *env_->read_limit_ - pos_));
      }
    }
    absl::StatusOr<size_t> r = base_->Read(buf, n);
    if (r.ok()) pos_ += *r;
    return r;
  }
  uint64_t Size() const override { return base_->Size(); }

 private:
  FaultInjectionEnv* const env_;
  const std::string path_;
  std::unique_ptr<ReadableFile> base_;
  uint64_t pos_ = 0;
};

void FaultInjectionEnv::FailWritesAfter(uint64_t bytes, int err) {
  absl::MutexLock l(&mu_);
  write_limit_ = bytes_written_ + bytes;
  write_err_ = err;
}
void FaultInjectionEnv::LimitWriteSize(size_t n) {
  absl::MutexLock l(&mu_);
  max_write_ = n;
}
void FaultInjectionEnv::StallWrites() {
  absl::MutexLock l(&mu_);
  stall_ = true;
}
void FaultInjectionEnv::FailSync(int err) {
  absl::MutexLock l(&mu_);
  sync_err_ = err;
}
void FaultInjectionEnv::FailClose(int err) {
  absl::MutexLock l(&mu_);
  close_err_ = err;
}
void FaultInjectionEnv::FailRename(int err) {
  absl::MutexLock l(&mu_);
  rename_err_ = err;
}
void FaultInjectionEnv::FailSyncDir(int err) {
  absl::MutexLock l(&mu_);
  sync_dir_err_ = err;
}
void FaultInjectionEnv::FailReadsAfter(uint64_t bytes, int err) {
  absl::MutexLock l(&mu_);
  read_limit_ = bytes;
  read_err_ = err;
}
void FaultInjectionEnv::ReportFreeBytes(uint64_t bytes) {
  absl::MutexLock l(&mu_);
  free_bytes_ = bytes;
}
void FaultInjectionEnv::ClearFaults() {
  absl::MutexLock l(&mu_);
  write_limit_.reset();
  max_write_ = 0;
  stall_ = false;
  sync_err_ = close_err_ = rename_err_ = sync_dir_err_ = 0;
  read_limit_.reset();
  free_bytes_.reset();
}

uint64_t FaultInjectionEnv::bytes_written() const {
  absl::MutexLock l(&mu_);
  return bytes_written_;
}
int FaultInjectionEnv::syncs() const {
  absl::MutexLock l(&mu_);
  return syncs_;
}
int FaultInjectionEnv::dir_syncs() const {
  absl::MutexLock l(&mu_);
  return dir_syncs_;
}
int FaultInjectionEnv::renames() const {
  absl::MutexLock l(&mu_);
  return renames_;
}
int FaultInjectionEnv::writes() const {
  absl::MutexLock l(&mu_);
  return writes_;
}

absl::StatusOr<size_t> FaultInjectionEnv::AdmitWrite(const std::string& path, size_t n) {
  absl::MutexLock l(&mu_);
  ++writes_;
  if (stall_) return size_t{0};
  if (max_write_ != 0) n = std::min(n, max_write_);
  if (write_limit_.has_value()) {
    if (bytes_written_ >= *write_limit_) return ErrnoToStatus(write_err_, "write", path);
    n = static_cast<size_t>(std::min<uint64_t>(n, *write_limit_ - bytes_written_));
  }
  return n;
}

void FaultInjectionEnv::Wrote(size_t n) {
  absl::MutexLock l(&mu_);
  bytes_written_ += n;
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectionEnv::NewWritableFile(
    const std::string& path, uint32_t mode) {
  absl::StatusOr<std::unique_ptr<WritableFile>> f = base_->NewWritableFile(path, mode);
  if (!f.ok()) return f.status();
  return std::make_unique<FaultyWritableFile>(this, path, std::move(*f));
}

absl::StatusOr<std::unique_ptr<ReadableFile>> FaultInjectionEnv::NewReadableFile(
    const std::string& path) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> f = base_->NewReadableFile(path);
  if (!f.ok()) return f.status();
  return std::make_unique<FaultyReadableFile>(this, path, std::move(*f));
}

absl::Status FaultInjectionEnv::RenameFile(const std::string& from, const std::string& to) {
  {
    absl::MutexLock l(&mu_);
    ++renames_;
    if (rename_err_ != 0) return ErrnoToStatus(rename_err_, absl::StrCat("rename ", from, " to"), to);
  }
  return base_->RenameFile(from, to);
}

absl::Status FaultInjectionEnv::SyncDir(const std::string& dir) {
  {
    absl::MutexLock l(&mu_);
    ++dir_syncs_;
    if (sync_dir_err_ != 0) return ErrnoToStatus(sync_dir_err_, "fsync directory", dir);
  }
  return base_->SyncDir(dir);
}

absl::StatusOr<uint64_t> FaultInjectionEnv::FreeBytes(const std::string& dir) {
  {
    absl::MutexLock l(&mu_);
    if (free_bytes_.has_value()) return *free_bytes_;
  }
  return base_->FreeBytes(dir);
}

// --- MemEnv ---

class MemWritableFile final : public WritableFile {
 public:
  MemWritableFile(MemEnv* env, std::string path) : env_(env), path_(std::move(path)) {}
  absl::StatusOr<size_t> Write(const char* data, size_t n) override {
    absl::MutexLock l(&env_->mu_);
    env_->files_[path_].append(data, n);
    return n;
  }
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  MemEnv* const env_;
  const std::string path_;
};

namespace {
class MemReadableFile final : public ReadableFile {
 public:
  explicit MemReadableFile(std::string contents) : contents_(std::move(contents)) {}
  absl::StatusOr<size_t> Read(char* buf, size_t n) override {
    n = std::min(n, contents_.size() - pos_);
    std::memcpy(buf, contents_.data() + pos_, n);
    pos_ += n;
    return n;
  }
  uint64_t Size() const override { return contents_.size(); }

 private:
  const std::string contents_;
  size_t pos_ = 0;
};
}  // namespace

void MemEnv::Put(const std::string& path, std::string contents) {
  absl::MutexLock l(&mu_);
  files_[path] = std::move(contents);
}
std::optional<std::string> MemEnv::Get(const std::string& path) const {
  absl::MutexLock l(&mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return std::nullopt;
  return it->second;
}
std::vector<std::string> MemEnv::Files() const {
  absl::MutexLock l(&mu_);
  std::vector<std::string> out;
  for (const auto& [k, v] : files_) out.push_back(k);
  return out;
}
absl::StatusOr<std::unique_ptr<WritableFile>> MemEnv::NewWritableFile(const std::string& path,
                                                                      uint32_t) {
  absl::MutexLock l(&mu_);
  files_[path].clear();
  return std::make_unique<MemWritableFile>(this, path);
}
absl::StatusOr<std::unique_ptr<ReadableFile>> MemEnv::NewReadableFile(const std::string& path) {
  absl::MutexLock l(&mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return ErrnoToStatus(ENOENT, "open", path);
  return std::make_unique<MemReadableFile>(it->second);
}
bool MemEnv::FileExists(const std::string& path) {
  absl::MutexLock l(&mu_);
  return files_.count(path) != 0;
}
absl::StatusOr<std::vector<std::string>> MemEnv::GetChildren(const std::string& dir) {
  absl::MutexLock l(&mu_);
  const std::string prefix = dir == "/" ? dir : dir + "/";
  std::vector<std::string> out;
  for (const auto& [path, contents] : files_) {
    if (path.compare(0, prefix.size(), prefix) == 0 &&
        path.find('/', prefix.size()) == std::string::npos) {
      out.push_back(path.substr(prefix.size()));
    }
  }
  return out;
}

absl::Status MemEnv::RenameFile(const std::string& from, const std::string& to) {
  absl::MutexLock l(&mu_);
  auto it = files_.find(from);
  if (it == files_.end()) return ErrnoToStatus(ENOENT, "rename", from);
  files_[to] = std::move(it->second);
  files_.erase(from);
  return absl::OkStatus();
}
absl::Status MemEnv::DeleteFile(const std::string& path) {
  absl::MutexLock l(&mu_);
  if (files_.erase(path) == 0) return ErrnoToStatus(ENOENT, "unlink", path);
  return absl::OkStatus();
}

}  // namespace dos::testing
