// CheckpointWriter: writes one shard's checkpoint (format in
// checkpoint_format.h) atomically: everything goes to a temporary file in the
// destination's directory, which is fsynced, closed and renamed over the
// destination, and then the directory is fsynced. Until Commit() returns OK
// the previous file at the destination is untouched; on any failure, and when
// the writer is destroyed uncommitted, the temporary file is deleted.
//
//   auto w = CheckpointWriter::Create(path, layout, env);
//   for each tensor t, for each array a (master, exp_avg, exp_avg_sq):
//     w->BeginSection(t, a); w->Append(values, n) ...; w->EndSection();
//   w->Commit();
//
// Values are streamed: the writer holds one chunk (1 MiB by default), never a
// whole tensor. Sections must come in file order; the first error sticks and
// every later call returns it. A full disk is RESOURCE_EXHAUSTED naming the
// destination, the bytes written and the bytes free.
//
// Ownership: `env` must outlive the writer. Thread-safety: none (one thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/checkpoint/checkpoint_format.h"
#include "daemon/checkpoint/env.h"

namespace dos {

struct CheckpointWriterOptions {
  uint32_t file_mode = 0600;  // the state is the job's: only dosd reads it
  uint32_t chunk_bytes = kDefaultChunkBytes;
  // Refuse up front (RESOURCE_EXHAUSTED) when the file system reports less
  // free space than the checkpoint needs, rather than fill the disk.
  bool check_free_space = true;
  uint64_t created_unix_seconds = 0;  // 0: now
};

class CheckpointWriter {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(
      const std::string& path, CheckpointLayout layout, Env* env,
      const CheckpointWriterOptions& options = {});
  ~CheckpointWriter();  // Abandons an uncommitted checkpoint.
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  absl::Status BeginSection(uint32_t tensor, StateArray which);
  // Values of the open section: fp32 (Append) or, for the moments of a
  // compact layout, bf16 (AppendBf16); the other is FAILED_PRECONDITION.
  absl::Status Append(const float* values, size_t n);
  absl::Status AppendBf16(const uint16_t* values, size_t n);
  // FAILED_PRECONDITION unless exactly the tensor's numel values came.
  absl::Status EndSection();
  // Trailer, fsync, close, rename over the destination, fsync the directory.
  absl::Status Commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t expected_bytes() const { return expected_bytes_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  CheckpointWriter(std::string path, CheckpointLayout layout, Env* env,
                   const CheckpointWriterOptions& options);
  absl::Status Start();
  absl::Status WriteAll(const char* data, size_t n);
  absl::Status FlushChunk();
  absl::Status AppendBytes(const void* values, size_t n, uint64_t elem_bytes);
  // Records the first error, deletes the temporary file, returns the error.
  absl::Status Fail(absl::Status status);
  void Abandon();

  const std::string path_;
  const CheckpointLayout layout_;
  Env* const env_;
  const CheckpointWriterOptions options_;
  std::string temp_path_;
  std::unique_ptr<WritableFile> file_;
  absl::Status error_;
  bool temp_live_ = false;  // the temporary file exists and is ours to delete
  bool committed_ = false;
  uint64_t expected_bytes_ = 0;
  uint64_t bytes_written_ = 0;

  // Section cursor: sections are numbered tensor * 3 + array.
  uint64_t next_section_ = 0;
  bool in_section_ = false;
  uint64_t section_elems_ = 0;  // values appended to the open section
  std::vector<char> chunk_;     // chunk_bytes of values + room for the CRC
  size_t chunk_fill_ = 0;       // bytes of values in chunk_
};

// Deletes the temporary files that writers killed mid-checkpoint (SIGKILL,
// power loss) left in `dir` ("<name>.tmp.<pid>.<n>" of a pid other than this
// process). Call once at startup, before any checkpoint is written. Returns
// how many files were removed.
absl::StatusOr<int> RemoveStaleCheckpointTemporaries(const std::string& dir, Env* env);

}  // namespace dos
