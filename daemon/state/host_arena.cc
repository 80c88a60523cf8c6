#include "daemon/state/host_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/state/host_memory_budget.h"
#include "tbb/blocked_range.h"
#include "tbb/parallel_for.h"

namespace dos {
namespace {
// Unit of parallel first touch: large enough that scheduling is noise, small
// enough that 16 threads share a 1 GiB subgroup and progress moves smoothly.
constexpr uint64_t kTouchChunk = uint64_t{32} << 20;

// Debian's oneTBB is not built with ThreadSanitizer, so TSan cannot see the
// synchronisation inside tbb::parallel_for and reports races in TBB itself:
// under TSan the first touch runs on the calling thread (same result).
#if defined(__SANITIZE_THREAD__)
constexpr bool kSerialTouch = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kSerialTouch = true;
#else
constexpr bool kSerialTouch = false;
#endif
#else
constexpr bool kSerialTouch = false;
#endif
constexpr uint64_t kPage = 4096;

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }
}  // namespace

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(std::span<const uint64_t> slot_bytes,
                                                             const Options& options,
                                                             absl::string_view what) {
  std::unique_ptr<HostArena> a(new HostArena());
  uint64_t total = 0;
  for (uint64_t b : slot_bytes) total += RoundUp(std::max<uint64_t>(b, 1), kPage);
  a->huge_ = options.huge_pages && total >= kHugePageThreshold;
  const uint64_t align = a->huge_ ? kHugePage : kPage;
  uint64_t offset = 0;
  for (uint64_t b : slot_bytes) {
    a->offsets_.push_back(offset);
    a->rounded_.push_back(RoundUp(std::max<uint64_t>(b, 1), kPage));
    offset += RoundUp(std::max<uint64_t>(b, 1), align);
  }
  // The state lives in a memfd (shmem), mapped shared, so that dosd can hand
  // its owner a read-only descriptor of it (StateMemoryFd): the owner's
  // state_dict() maps its state instead of copying it. Its size is sealed:
  // nobody, dosd included, can shrink it under a mapping (a SIGBUS), and
  // its seals are final. Mode 0600 (memfds start 0777): a holder of the
  // read-only descriptor cannot reopen it writable through /proc/PID/fd
  // (trainers run under other uids than dosd's).
  a->file_bytes_ = std::max<uint64_t>(offset, kPage);
  UniqueFd fd(static_cast<int>(::memfd_create("dos-state", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!fd.valid() || ::fchmod(fd.get(), 0600) != 0 ||
      ::ftruncate(fd.get(), static_cast<off_t>(a->file_bytes_)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    // Private memory still holds the state; only the owner's zero-copy view
    // is lost (state_dict() then copies). RLIMIT_FSIZE limits memfds too.
    a->unshared_reason_ = absl::StrCat("memfd of ", FormatBytes(a->file_bytes_), ": ",
                                       std::strerror(errno));
    DOS_LOG_WARNING("state.not_shareable", "what", what, "error", a->unshared_reason_,
                    "fix", "raise dosd's RLIMIT_FSIZE (ulimit -f unlimited); state_dict() of "
                    "this session copies its state");
    fd.reset();
  }
  // Over-map by one huge page so the slots can start 2 MiB-aligned: reserve
  // the range, then map the memfd at its aligned start.
  const uint64_t map_bytes = a->file_bytes_ + (a->huge_ ? kHugePage : 0);
  void* p = ::mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  char* aligned = nullptr;
  if (p != MAP_FAILED) {
    char* base = static_cast<char*>(p);
    a->base_ = base;
    a->mapped_ = map_bytes;
    aligned = a->huge_
                  ? reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(base), kHugePage))
                  : base;
    const bool shared = fd.valid();
    if (::mmap(aligned, a->file_bytes_, PROT_READ | PROT_WRITE,
               (shared ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS) | MAP_FIXED,
               shared ? fd.get() : -1, 0) == MAP_FAILED) {
      p = MAP_FAILED;
    }
  }
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": cannot map ", FormatBytes(map_bytes), " of host memory for the optimizer "
        "state (", std::strerror(errno), "); the host is out of memory or address space"));
  }
  a->fd_ = std::move(fd);
  a->data_ = aligned;
  for (uint64_t& o : a->offsets_) a->file_offsets_.push_back(o);
  for (uint64_t& o : a->offsets_) o += static_cast<uint64_t>(aligned - a->base_);
  if (a->huge_) {
    // Advisory: without THP for shmem (shmem_enabled "never") the pages are
    // 4 KiB, which only costs speed.
    if (::madvise(aligned, offset, MADV_HUGEPAGE) != 0) {
      DOS_LOG_INFO("state.no_huge_pages", "error", std::strerror(errno));
      a->huge_ = false;
    }
  }
  return a;
}

HostArena::~HostArena() {
  if (base_ != nullptr) ::munmap(base_, mapped_);
}

absl::StatusOr<UniqueFd> HostArena::ReadOnlyFd() const {
  if (!fd_.valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state memory: this session's state is not shareable (", unshared_reason_,
        "); read it by copy (dos_state_read)"));
  }
  const std::string path = absl::StrCat("/proc/self/fd/", fd_.get());
  {
    std::lock_guard<std::mutex> lock(lease_mu_);
    if (!lease_fd_.valid()) {
      lease_fd_.reset(::open(path.c_str(), O_RDWR | O_CLOEXEC));
      if (!lease_fd_.valid()) {
        return absl::ResourceExhaustedError(
            absl::StrCat("state memory: cannot keep a descriptor to track its views (", path, ": ",
                         std::strerror(errno),
                         "); read the state by copy (dos_state_read), or raise dosd's "
                         "descriptor limit (LimitNOFILE)"));
      }
    }
  }
  // A new open file description, read-only: its holder can map the state
  // (MAP_PRIVATE; MAP_SHARED only without PROT_WRITE) but neither write,
  // resize nor seal it.
  UniqueFd ro(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!ro.valid()) {
    return absl::InternalError(absl::StrCat("cannot reopen the state's memfd read-only (", path,
                                            ": ", std::strerror(errno), ")"));
  }
  return ro;
}

UniqueFd HostArena::TakeLeaseFd() {
  std::lock_guard<std::mutex> lock(lease_mu_);
  return std::move(lease_fd_);
}

absl::Status HostArena::Touch(RegisterProgress* progress) {
  struct Chunk {
    char* begin;
    uint64_t bytes;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < offsets_.size(); ++i) {
    for (uint64_t off = 0; off < rounded_[i]; off += kTouchChunk) {
      chunks.push_back({base_ + offsets_[i] + off, std::min(kTouchChunk, rounded_[i] - off)});
    }
  }
  // Writing one byte per 4 KiB page faults it in (the kernel zeroes it; a
  // huge page is faulted whole by its first write). oneTBB itself may throw
  // (std::bad_alloc): this is the one place that turns it into a Status.
  auto touch = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t c = r.begin(); c != r.end(); ++c) {
      volatile char* p = chunks[c].begin;
      for (uint64_t off = 0; off < chunks[c].bytes; off += kPage) p[off] = 0;
      if (progress != nullptr) progress->Add(chunks[c].bytes);
    }
  };
  try {
    if (kSerialTouch) {
      touch(tbb::blocked_range<size_t>(0, chunks.size(), 1));
    } else {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks.size(), 1), touch);
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("first touch of the optimizer state failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace dos
