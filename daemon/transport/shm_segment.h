// POSIX shared-memory segments (Boost.Interprocess behind a Status API).
//
// A ShmSegment owns one mapping of one shm object. Create() makes a new
// object (fails with ALREADY_EXISTS if the name is taken), sizes it and maps
// it; Open() maps an existing one read-write. The object's name is unlinked
// by Unlink() or, for segments created with `unlink_on_destroy`, by the
// destructor; the mapping itself lives until the ShmSegment is destroyed, so
// a peer that mapped it keeps a valid mapping after the name is gone.
//
// Boost.Interprocess throws; this class is the one place that catches and
// turns its exceptions into absl::Status. Not thread-safe to mutate; the
// mapped bytes are shared by design.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace dos {

class ShmSegment {
 public:
  struct CreateOptions {
    mode_t mode = 0660;          // permissions of the new object
    bool unlink_on_destroy = true;
  };

  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(std::string_view name, uint64_t bytes,
                                                           const CreateOptions& options);
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(std::string_view name, uint64_t bytes) {
    return Create(name, bytes, CreateOptions{});
  }
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(std::string_view name);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Removes the name; existing mappings stay valid. Idempotent.
  void Unlink();

 private:
  ShmSegment(std::string name, void* data, uint64_t size, bool unlink_on_destroy);
  std::string name_;
  void* data_;
  uint64_t size_;
  bool unlink_on_destroy_;
  bool unlinked_ = false;
};

}  // namespace dos
