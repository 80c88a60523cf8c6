// SubgroupQueue: the step's subgroups, claimed by the CPU pool and the GPU
// pipeline as each becomes free (DESIGN.md section 4, "dynamic claiming").
//
// A subgroup is either pinned to one side (the fixed policies place every
// subgroup up front: `cpu`, `static`, `interleave`) or shared (`auto`): the
// GPU takes shared subgroups from the front, the CPU from the back, so the
// two meet wherever their real speeds put the boundary and the tail of the
// phase balances itself. The GPU side asks a predicate before taking a
// shared subgroup (would it finish sooner than the CPU would?); the CPU
// always takes what is left.
//
// Thread-safety: all methods are thread-safe (one mutex; claims happen once
// per subgroup, some tens per step, so contention is irrelevant).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dos {

class SubgroupQueue {
 public:
  // `numel[i]` is subgroup i's element count (for the predicate).
  SubgroupQueue(std::vector<uint32_t> gpu_only, std::vector<uint32_t> cpu_only,
                std::vector<uint32_t> shared, std::vector<uint64_t> numel)
      : gpu_only_(gpu_only.begin(), gpu_only.end()),
        cpu_only_(cpu_only.begin(), cpu_only.end()),
        shared_(shared.begin(), shared.end()),
        numel_(std::move(numel)) {
    for (uint32_t i : shared_) shared_params_ += numel_[i];
  }

  // GPU side: its own subgroups first, then the front shared one if
  // `take(numel_of_next, shared_params_left_including_it)` says so.
  std::optional<uint32_t> ClaimGpu(const std::function<bool(uint64_t, uint64_t)>& take) {
    absl::MutexLock lock(&mu_);
    if (!gpu_only_.empty()) return Pop(&gpu_only_, true);
    if (shared_.empty() || !take(numel_[shared_.front()], shared_params_)) return std::nullopt;
    return PopShared(true);
  }
  // CPU side: its own subgroups first, then the back shared one.
  std::optional<uint32_t> ClaimCpu() {
    absl::MutexLock lock(&mu_);
    if (!cpu_only_.empty()) return Pop(&cpu_only_, true);
    if (shared_.empty()) return std::nullopt;
    return PopShared(false);
  }
  // True while the GPU side could still be handed work (own or shared).
  bool GpuMayHaveWork() const {
    absl::MutexLock lock(&mu_);
    return !gpu_only_.empty() || !shared_.empty();
  }

 private:
  static uint32_t Pop(std::deque<uint32_t>* q, bool front) {
    uint32_t v = front ? q->front() : q->back();
    if (front) q->pop_front(); else q->pop_back();
    return v;
  }
  uint32_t PopShared(bool front) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint32_t v = Pop(&shared_, front);
    shared_params_ -= numel_[v];
    return v;
  }

  mutable absl::Mutex mu_;
  std::deque<uint32_t> gpu_only_ ABSL_GUARDED_BY(mu_);
  std::deque<uint32_t> cpu_only_ ABSL_GUARDED_BY(mu_);
  std::deque<uint32_t> shared_ ABSL_GUARDED_BY(mu_);
  uint64_t shared_params_ ABSL_GUARDED_BY(mu_) = 0;
  const std::vector<uint64_t> numel_;
};

}  // namespace dos
