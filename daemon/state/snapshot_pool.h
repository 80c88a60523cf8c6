// SnapshotPool: the host memory a checkpoint's copy-on-write may take.
//
// A checkpoint is written straight from the state, subgroup by subgroup
// (ShardState's snapshot). A step that is about to write a subgroup the
// writer has not reached copies it first, into a buffer from this pool, and
// goes on; when the pool is spent it waits instead, until the writer has
// written that subgroup from the state itself. So a save holds at most the
// pool's limit beside the state (not a second copy of it: 81 GB at 7B fp32),
// and each buffer is freed once its subgroup is written.
//
// Three bounds: the pool's own limit (--checkpoint_staging_limit); when
// given, the daemon's HostMemoryBudget (--host_memory_limit), which the
// buffers are charged to while they live; and what a registration checks
// (CheckHostCanHold: the host's MemAvailable and dosd's memory cgroup, each
// less a reserve): a save never takes memory the host or the cgroup has not
// got.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "daemon/state/host_memory_budget.h"

namespace dos {

class SnapshotPool {
 public:
  // A buffer of the pool's: anonymous memory, unmapped and given back on
  // destruction. Empty (false) when the pool had no room.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& o) noexcept { *this = std::move(o); }
    Buffer& operator=(Buffer&& o) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { Reset(); }
    void Reset();
    explicit operator bool() const { return data_ != nullptr; }
    void* data() const { return data_; }
    uint64_t bytes() const { return bytes_; }

   private:
    friend class SnapshotPool;
    SnapshotPool* pool_ = nullptr;
    void* data_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // limit_bytes 0: no buffers at all (steps wait for the writer); `budget`
  // may be null (only the pool's own limit). `can_hold(bytes)` says whether
  // the host can hold that much more now (default: CheckHostCanHold; tests
  // pass their own).
  using CanHoldFn = std::function<bool(uint64_t bytes)>;
  SnapshotPool(uint64_t limit_bytes, HostMemoryBudget* budget, CanHoldFn can_hold = {});
  SnapshotPool(const SnapshotPool&) = delete;
  SnapshotPool& operator=(const SnapshotPool&) = delete;
  ~SnapshotPool();  // every Buffer must be gone

  // A buffer of `bytes`, or an empty one when that would pass the limit or
  // the budget, or the memory cannot be mapped. Never waits.
  Buffer TryTake(uint64_t bytes);

  uint64_t limit() const { return limit_; }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  // The most it held at once since the last call (reset to what it holds).
  uint64_t TakePeak();

 private:
  void Give(void* data, uint64_t bytes);

  const uint64_t limit_;
  HostMemoryBudget* const budget_;
  const CanHoldFn can_hold_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> peak_{0};
};

// --checkpoint_staging_limit's "auto": a quarter of the host's memory.
uint64_t DefaultSnapshotPoolLimit();

}  // namespace dos
