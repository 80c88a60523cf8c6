// Shared-memory segments passed by descriptor: sealed memfds, mapped with
// Boost.Interprocess behind a Status API.
//
// A ShmSegment owns one memfd and one shared read-write mapping of all of it.
// Nothing has a name in /dev/shm: another process reaches the memory only if
// it is handed the descriptor (SCM_RIGHTS over a unix socket, see
// fd_protocol.h), so there is nothing to guess, open or squat.
//
// Create() makes a new memfd of `bytes` (page-rounded by the kernel's
// mapping), reserves its pages, seals it against resizing (F_SEAL_SHRINK,
// F_SEAL_GROW, then F_SEAL_SEAL) and maps it. Adopt() maps a descriptor
// received from a peer, after checking that it is a memfd (shmem, not
// hugetlbfs) carrying those three seals: a peer can then neither shrink the
// memory under our mapping (the SIGBUS an ftruncate to 0 would cause) nor
// grow it, nor lift the seals. An unsealed descriptor is refused with
// FAILED_PRECONDITION naming the missing seal.
//
// Boost.Interprocess throws; this file is the one place that catches and
// turns its exceptions into absl::Status, whose messages carry the label,
// the size, the errno text and what the caller can do about it.
//
// Thread-safety: not thread-safe to destroy; the mapped bytes are shared by
// design and their synchronization is the user's.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dos/wire/unique_fd.h"

namespace dos {

class ShmSegment {
 public:
  // Seals every segment carries (and Adopt requires).
  static constexpr int kRequiredSeals = 0x0002 | 0x0004 | 0x0001;  // SHRINK | GROW | SEAL

  struct CreateOptions {
    // Allocate the backing pages now (fallocate). shmem hands out pages
    // lazily; without this, a memory-starved machine shows up as SIGBUS at
    // first touch instead of a RESOURCE_EXHAUSTED here.
    bool reserve = true;
  };

  // `label` names the memfd in /proc/<pid>/fd and in error messages only
  // (e.g. "dos.ctl.3"); it is not a path and nobody can open it.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(absl::string_view label, uint64_t bytes,
                                                            const CreateOptions& options);
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(absl::string_view label,
                                                            uint64_t bytes) {
    return Create(label, bytes, CreateOptions{});
  }
  // Maps a descriptor received from a peer (taking ownership of it), after
  // the checks above; size() is the memfd's size. `what` names it in errors.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Adopt(UniqueFd fd, absl::string_view what);

  // OK if `fd` is a sealed memfd that Adopt would accept; else the reason.
  static absl::Status CheckSealed(int fd, absl::string_view what);
  // CheckSealed, then the memfd's size: what Adopt would map (a receiver
  // charges it before mapping anything).
  static absl::StatusOr<uint64_t> SealedSize(int fd, absl::string_view what);

  // Runs `f` once the mapping is gone (when the segment is destroyed): a
  // receiver gives back what it charged for the mapping. Once.
  void SetOnUnmap(std::function<void()> f) { on_unmap_ = std::move(f); }

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& label() const { return label_; }
  // The memfd of a Create()d segment, for passing to the peer (the segment
  // keeps owning it); -1 for an adopted one, which keeps only its mapping.
  int fd() const { return fd_.get(); }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  struct Mapping;  // the Boost mapped_region, kept out of this header

  ShmSegment(std::string label, UniqueFd fd, std::unique_ptr<Mapping> mapping);

  std::string label_;
  UniqueFd fd_;
  std::unique_ptr<Mapping> mapping_;
  void* data_;
  uint64_t size_;
  std::function<void()> on_unmap_;
};

}  // namespace dos
