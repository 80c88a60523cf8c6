// SubgroupQueue: the step's subgroups, claimed by the CPU pool and the GPU
// pipeline as each becomes free (DESIGN.md section 4, "dynamic claiming").
//
// A subgroup is either pinned to one side (the fixed policies place every
// subgroup up front: `cpu`, `static`, `interleave`) or shared (`auto`): the
// GPU takes shared subgroups from the front, the CPU from the back, so the
// two meet wherever their real speeds put the boundary and the tail of the
// phase balances itself. The GPU side asks a predicate before taking a
// shared subgroup (would it finish sooner than the CPU would?); the CPU
// always takes what is left, and reports each subgroup it has finished
// (CpuDone), so that the predicate sees what the CPU still has to do, not
// only what is unclaimed.
//
// Thread-safety: all methods are thread-safe (one mutex; claims happen once
// per subgroup, some tens per step, so contention is irrelevant).
#pragma once

#include <algorithm>
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
  // What the GPU side's predicate is asked about the front shared subgroup.
  struct SharedClaim {
    uint64_t numel = 0;        // its parameters
    uint64_t shared_left = 0;  // shared parameters still unclaimed, it included
    // Parameters the CPU still has to update before it would reach the
    // shared ones: its pinned subgroups and those it claimed and has not
    // finished (the one it is updating counted whole).
    uint64_t cpu_left = 0;
  };
  using TakeShared = std::function<bool(const SharedClaim&)>;

  // `numel[i]` is subgroup i's element count (for the predicate).
  SubgroupQueue(std::vector<uint32_t> gpu_only, std::vector<uint32_t> cpu_only,
                std::vector<uint32_t> shared, std::vector<uint64_t> numel)
      : gpu_only_(gpu_only.begin(), gpu_only.end()),
        cpu_only_(cpu_only.begin(), cpu_only.end()),
        shared_(shared.begin(), shared.end()),
        numel_(std::move(numel)) {
    for (uint32_t i : shared_) shared_params_ += numel_[i];
    for (uint32_t i : cpu_only_) cpu_left_ += numel_[i];
  }

  // GPU side: its own subgroups first, then the front shared one if `take`
  // says so.
  std::optional<uint32_t> ClaimGpu(const TakeShared& take) {
    absl::MutexLock lock(&mu_);
    if (!gpu_only_.empty()) return Pop(&gpu_only_, true);
    if (shared_.empty() ||
        !take({.numel = numel_[shared_.front()], .shared_left = shared_params_,
               .cpu_left = cpu_left_})) {
      return std::nullopt;
    }
    return PopShared(true);
  }
  // CPU side: its own subgroups first, then the back shared one.
  std::optional<uint32_t> ClaimCpu() {
    absl::MutexLock lock(&mu_);
    if (!cpu_only_.empty()) return Pop(&cpu_only_, true);
    if (shared_.empty()) return std::nullopt;
    const uint32_t sg = PopShared(false);
    cpu_left_ += numel_[sg];
    return sg;
  }
  // CPU side: subgroup `sg` (claimed by ClaimCpu) is updated.
  void CpuDone(uint32_t sg) {
    absl::MutexLock lock(&mu_);
    cpu_left_ -= std::min(cpu_left_, numel_[sg]);
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
  uint64_t cpu_left_ ABSL_GUARDED_BY(mu_) = 0;
  const std::vector<uint64_t> numel_;
};

}  // namespace dos
