#include "daemon/state/snapshot_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <utility>

#include "daemon/common/log.h"

namespace dos {

SnapshotPool::Buffer& SnapshotPool::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void SnapshotPool::Buffer::Reset() {
  if (data_ != nullptr) pool_->Give(data_, bytes_);
  pool_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

SnapshotPool::SnapshotPool(uint64_t limit_bytes, HostMemoryBudget* budget, AvailableFn available)
    : limit_(limit_bytes),
      budget_(budget),
      available_(available ? std::move(available) : AvailableFn(HostMemoryAvailable)),
      keep_free_(std::max<uint64_t>(uint64_t{1} << 30, HostMemoryBytes() / 20)) {}

SnapshotPool::~SnapshotPool() {
  if (used() != 0) {
    DOS_LOG_ERROR("checkpoint.staging_leaked", "bytes", used());
  }
}

SnapshotPool::Buffer SnapshotPool::TryTake(uint64_t bytes) {
  Buffer b;
  if (bytes == 0) return b;
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit_ || used > limit_ - bytes) return b;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  if (const uint64_t avail = available_(); avail < keep_free_ || avail - keep_free_ < bytes) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return b;
  }
  if (budget_ != nullptr &&
      !budget_
           ->Reserve(bytes, "a checkpoint's copy-on-write", "checkpoint staging",
                     "the step waits for the checkpoint writer instead")
           .ok()) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return b;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    if (budget_ != nullptr) budget_->Release(bytes);
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return b;
  }
  (void)::madvise(p, bytes, MADV_HUGEPAGE);  // fewer faults for the copy; advisory
  uint64_t peak = peak_.load(std::memory_order_relaxed);
  const uint64_t now = used + bytes;
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  b.pool_ = this;
  b.data_ = p;
  b.bytes_ = bytes;
  return b;
}

void SnapshotPool::Give(void* data, uint64_t bytes) {
  ::munmap(data, bytes);
  if (budget_ != nullptr) budget_->Release(bytes);
  used_.fetch_sub(bytes, std::memory_order_relaxed);
}

uint64_t SnapshotPool::TakePeak() { return peak_.exchange(used(), std::memory_order_relaxed); }

uint64_t HostMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{16} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

uint64_t DefaultSnapshotPoolLimit() { return HostMemoryBytes() / 4; }

uint64_t HostMemoryAvailable() {
  std::FILE* f = std::fopen("/proc/meminfo", "re");
  if (f == nullptr) return UINT64_MAX;
  char line[256];
  uint64_t kib = 0;
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f) != nullptr) {
    found = std::sscanf(line, "MemAvailable: %" SCNu64 " kB", &kib) == 1;
  }
  std::fclose(f);
  return found ? kib << 10 : UINT64_MAX;
}

}  // namespace dos
