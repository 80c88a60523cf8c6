// POSIX shared-memory segments (Boost.Interprocess behind a Status API).
//
// A ShmSegment owns one mapping of one shm object. Create() makes a new
// object (fails with ALREADY_EXISTS if the name is taken), sizes it and maps
// it; Open() maps an existing one read-write, at the object's full size. The
// object's name is unlinked by Unlink() or, for segments created with
// `unlink_on_destroy`, by the destructor; the mapping itself lives until the
// ShmSegment is destroyed, so a peer that mapped it keeps a valid mapping
// after the name is gone.
//
// Names follow shm_open(3): "/name", no other '/', at most kMaxNameLength
// characters; the object appears as /dev/shm/name.
//
// Boost.Interprocess throws; this class is the one place that catches and
// turns its exceptions into absl::Status, whose messages carry the name, the
// size, the errno text and what the operator can do about it.
//
// Thread-safety: not thread-safe to mutate (Unlink, destruction); the mapped
// bytes are shared by design and their synchronization is the user's.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dos {

class ShmSegment {
 public:
  // Longest accepted name, leading '/' included (NAME_MAX is 255 for the
  // /dev/shm entry; leave room for callers' suffixes).
  static constexpr size_t kMaxNameLength = 250;

  struct CreateOptions {
    // Permissions of the new object, applied exactly (fchmod after creation,
    // so the process umask neither weakens nor strengthens them).
    mode_t mode = 0660;
    bool unlink_on_destroy = true;
    // Allocate the backing pages now (posix_fallocate). tmpfs hands out pages
    // lazily; without this, a full /dev/shm shows up as SIGBUS at first
    // touch instead of a RESOURCE_EXHAUSTED here.
    bool reserve = true;
  };

  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(std::string_view name, uint64_t bytes,
                                                            const CreateOptions& options);
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(std::string_view name, uint64_t bytes) {
    return Create(name, bytes, CreateOptions{});
  }
  // Maps an existing object read-write; size() is the object's size.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(std::string_view name);

  // OK, or INVALID_ARGUMENT saying what is wrong with `name`.
  static absl::Status ValidateName(std::string_view name);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Removes the name; existing mappings stay valid. Idempotent.
  void Unlink();

 private:
  struct Mapping;  // the Boost mapped_region, kept out of this header

  ShmSegment(std::string name, std::unique_ptr<Mapping> mapping, bool unlink_on_destroy);

  std::string name_;
  std::unique_ptr<Mapping> mapping_;
  void* data_;
  uint64_t size_;
  bool unlink_on_destroy_;
  bool unlinked_ = false;
};

}  // namespace dos
