#include "daemon/state/snapshot_pool.h"

#include <sys/mman.h>

#include <utility>

#include "daemon/common/log.h"
#include "daemon/state/host_guard.h"

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

SnapshotPool::SnapshotPool(uint64_t limit_bytes, HostMemoryBudget* budget, CanHoldFn can_hold)
    : limit_(limit_bytes),
      budget_(budget),
      can_hold_(can_hold ? std::move(can_hold)
                         : CanHoldFn([](uint64_t b) { return CheckHostCanHold(b, "").ok(); })) {}

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
  if (!can_hold_(bytes)) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return b;
  }
  if (budget_ != nullptr && !budget_->ReserveStaging(bytes).ok()) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return b;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    if (budget_ != nullptr) budget_->ReleaseStaging(bytes);
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
  if (budget_ != nullptr) budget_->ReleaseStaging(bytes);
  used_.fetch_sub(bytes, std::memory_order_relaxed);
}

uint64_t SnapshotPool::TakePeak() { return peak_.exchange(used(), std::memory_order_relaxed); }

uint64_t DefaultSnapshotPoolLimit() {
  const std::optional<uint64_t> total = HostMemoryTotal();
  return total ? *total / 4 : uint64_t{4} << 30;
}

}  // namespace dos
