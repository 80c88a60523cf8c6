// HostArena: the host memory of one shard's optimizer state, one memfd
// (shmem) mapped shared, cut into per-subgroup slots. The memfd's size is
// sealed; ReadOnlyFd() gives the session's owner a read-only descriptor of it
// (the zero-copy state_dict(): the owner maps its state, nothing is copied).
// Where no memfd can be made (RLIMIT_FSIZE smaller than the state), the
// state lives in private memory as before and ReadOnlyFd() says why.
//
// Why one mapping, filled in parallel: a 6B-parameter shard is ~71 GB of
// fp32 state. Allocated with malloc and zeroed by one thread it took most of
// a minute (a page fault per 4 KiB on one core). Here the kernel supplies
// zeroed pages and Touch() faults them in from every core (oneTBB over
// chunks); mappings of at least kHugePageThreshold ask for transparent huge
// pages (madvise MADV_HUGEPAGE, where the kernel offers them), so one fault
// maps 2 MiB and the GPU path's page-locking walks 512x fewer pages.
//
// Slots start on page boundaries (2 MiB ones with huge pages), so no two
// subgroups share a page and each slot can be page-locked on its own.
//
// Ownership: owns the mapping; unmapped on destruction. Thread-safety: Touch
// splits its own work; nothing else mutates.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/state/register_progress.h"
#include "dos/wire/unique_fd.h"

namespace dos {

class HostArena {
 public:
  // Mappings at least this large ask for transparent huge pages.
  static constexpr uint64_t kHugePageThreshold = uint64_t{64} << 20;
  static constexpr uint64_t kHugePage = uint64_t{2} << 20;

  struct Options {
    bool huge_pages = true;  // madvise(MADV_HUGEPAGE) large mappings
  };

  // Maps room for slots of `slot_bytes[i]` bytes each (zeroed, not yet
  // faulted in). `what` names the registration in errors.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(std::span<const uint64_t> slot_bytes,
                                                           const Options& options,
                                                           absl::string_view what);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Faults in every page of every slot from all cores (oneTBB), adding each
  // chunk's bytes to `progress` (may be null) as it is done.
  absl::Status Touch(RegisterProgress* progress);

  void* slot(size_t i) const { return base_ + offsets_[i]; }
  // Where slot i lies in the memfd (ReadOnlyFd) and the memfd's size.
  uint64_t file_offset(size_t i) const { return file_offsets_[i]; }
  uint64_t file_bytes() const { return file_bytes_; }
  // A new read-only descriptor of the state's memfd (O_RDONLY, close-on-exec).
  absl::StatusOr<UniqueFd> ReadOnlyFd() const;
  // Once ReadOnlyFd() has handed one out, a writable descriptor of the memfd
  // opened for HostMemoryBudget::HoldWhileViewed (the memfd's own does not
  // count as an open writer, and the kernel's lease check needs one that
  // does; opened at the first export, so that no view exists untracked);
  // invalid if none was handed out. The arena gives it up.
  UniqueFd TakeLeaseFd();
  // Bytes of slot i rounded up to whole pages (what may be page-locked).
  uint64_t slot_bytes(size_t i) const { return rounded_[i]; }
  size_t num_slots() const { return offsets_.size(); }
  void* base() const { return base_; }
  uint64_t mapped_bytes() const { return mapped_; }
  bool huge_pages() const { return huge_; }

 private:
  HostArena() = default;
  char* base_ = nullptr;  // the reserved range (mapped_ bytes)
  char* data_ = nullptr;  // where the memfd is mapped (file_bytes_ bytes)
  uint64_t mapped_ = 0;
  uint64_t file_bytes_ = 0;
  UniqueFd fd_;                  // invalid: private memory (unshared_reason_)
  std::string unshared_reason_;
  std::vector<uint64_t> file_offsets_;
  bool huge_ = false;
  mutable std::mutex lease_mu_;
  mutable UniqueFd lease_fd_;  // guarded by lease_mu_
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> rounded_;
};

}  // namespace dos
