// CheckpointReader: reads and verifies one shard's checkpoint (format in
// checkpoint_format.h). Nothing unverified leaves the reader: Open checks the
// header, the layout and the file's size against the layout (a truncated file
// is refused before any value is read); ReadSection hands values to its sink
// one chunk at a time, each only after its CRC matched; Finish checks the
// trailer.
//
// Errors: DATA_LOSS naming the path, the section and the file offset for any
// corruption or truncation; FAILED_PRECONDITION for a file that is not a DOS
// checkpoint of this version or a section asked for out of order.
//
//   auto r = CheckpointReader::Open(path, env);
//   r->layout() ...
//   for each tensor t, each array a: r->ReadSection(t, a, sink);
//   r->Finish();
//
// Ownership: `env` must outlive the reader. Thread-safety: none.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "daemon/checkpoint/checkpoint_format.h"
#include "daemon/checkpoint/env.h"

namespace dos {

class CheckpointReader {
 public:
  // Called with verified values: `first` is the index within the tensor of
  // values[0]. Always fp32: a compact checkpoint's bf16 moments are widened
  // (exactly) before the sink sees them.
  using Sink = absl::FunctionRef<void(uint64_t first, const float* values, size_t n)>;

  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& path,
                                                                Env* env);

  const CheckpointLayout& layout() const { return layout_; }
  uint64_t created_unix_seconds() const { return created_; }
  uint64_t file_bytes() const { return file_bytes_; }

  // Reads the next section, which must be (tensor, which) in file order.
  absl::Status ReadSection(uint32_t tensor, StateArray which, Sink sink);
  // After the last section: checks the trailer.
  absl::Status Finish();
  // Reads (and so verifies) every remaining section and the trailer.
  absl::Status VerifyAll();

 private:
  CheckpointReader(std::string path, std::unique_ptr<ReadableFile> file)
      : path_(std::move(path)), file_(std::move(file)) {}
  absl::Status ReadHeaderAndLayout();
  // Reads exactly n bytes; DATA_LOSS naming `what` if the file ends first.
  absl::Status ReadExact(char* buf, size_t n, absl::string_view what);
  absl::Status Corrupt(absl::string_view what, uint64_t offset, absl::string_view detail) const;
  absl::Status Fail(absl::Status status);

  const std::string path_;
  std::unique_ptr<ReadableFile> file_;
  CheckpointLayout layout_;
  uint64_t created_ = 0;
  uint64_t file_bytes_ = 0;
  uint32_t chunk_bytes_ = 0;
  uint64_t offset_ = 0;        // file position
  uint64_t next_section_ = 0;  // tensor * 3 + array
  std::vector<char> raw_;      // one chunk as stored
  std::vector<float> chunk_;   // the same values as fp32, aligned for the sink
  absl::Status error_;
};

}  // namespace dos
