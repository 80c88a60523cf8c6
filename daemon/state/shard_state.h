// ShardState: the fp32 optimizer state that the daemon holds for one
// session's shard (the tensors one trainer rank registered).
//
// The shard's tensors are laid end to end in one flat element space, which is
// cut into subgroups of at most `subgroup_size` elements: the unit that the
// scheduler places on the CPU or the GPU each step. A subgroup may span tensor
// boundaries; its segments say which run of which tensor it covers. Each
// subgroup's master weights, exp_avg and exp_avg_sq are one allocation, laid
// out [master | exp_avg | exp_avg_sq], so the GPU path can move a subgroup's
// whole state with one copy each way.
//
// Ownership: ShardState owns the state memory and returns its bytes to the
// HostMemoryBudget on destruction. Thread-safety: none; the owning Session
// serialises steps and state transfers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/dtype.h"
#include "daemon/state/host_memory_budget.h"
#include "proto/dos/v1/control_block.h"

namespace dos {

struct TensorInfo {
  std::string name;
  DType param_dtype = DType::kF32;
  DType grad_dtype = DType::kF32;
  uint64_t numel = 0;
  uint32_t group = 0;
  uint64_t flat_offset = 0;  // set by ShardState::Create
  int64_t step = 0;          // optimizer steps applied to this tensor
};

struct GroupConfig {
  GroupStepParams defaults{};
  bool decoupled_weight_decay = true;
};

// A contiguous run of one tensor inside a subgroup.
struct SubgroupSegment {
  uint32_t tensor;
  uint64_t tensor_offset;    // first element within the tensor
  uint64_t subgroup_offset;  // first element within the subgroup
  uint64_t count;
};

struct Subgroup {
  uint64_t flat_begin = 0;
  uint64_t numel = 0;
  std::vector<SubgroupSegment> segments;
  float* master = nullptr;      // numel each, back to back in one allocation
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

// Per-shard resources an engine attaches (page-locked registrations of the
// state, resident GPU copies): destroyed before the state memory is freed.
class ShardAttachment {
 public:
  virtual ~ShardAttachment() = default;
};

class ShardState {
 public:
  // Bytes of state per parameter: fp32 master, exp_avg, exp_avg_sq.
  static constexpr uint64_t kStateBytesPerParam = 12;

  // Lays out `tensors`, reserves the state's bytes from `budget` (which must
  // outlive the ShardState) and allocates it, zeroed. `what` names the
  // registration in error messages.
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(std::vector<TensorInfo> tensors,
                                                            std::vector<GroupConfig> groups,
                                                            uint64_t subgroup_size,
                                                            HostMemoryBudget* budget,
                                                            absl::string_view what);
  ~ShardState();
  ShardState(const ShardState&) = delete;
  ShardState& operator=(const ShardState&) = delete;

  std::span<TensorInfo> tensors() { return tensors_; }
  std::span<const TensorInfo> tensors() const { return tensors_; }
  std::span<const GroupConfig> groups() const { return groups_; }
  std::span<Subgroup> subgroups() { return subgroups_; }
  std::span<const Subgroup> subgroups() const { return subgroups_; }
  uint64_t total_params() const { return total_params_; }
  uint64_t subgroup_size() const { return subgroup_size_; }
  uint64_t state_bytes() const { return total_params_ * kStateBytesPerParam; }

  // Copies `n` elements of one state array of `tensor`, starting at
  // `tensor_offset`, out of (Read) or into (Write) `buf`. `which` is 0 for
  // master, 1 for exp_avg, 2 for exp_avg_sq.
  void ReadTensor(uint32_t tensor, int which, float* buf) const;
  void WriteTensor(uint32_t tensor, int which, const float* buf);

  // The GPU engine's per-shard resources (null in CPU mode).
  ShardAttachment* attachment() const { return attachment_.get(); }
  void set_attachment(std::unique_ptr<ShardAttachment> a) { attachment_ = std::move(a); }

 private:
  ShardState() = default;
  template <typename Fn>
  void ForEachRun(uint32_t tensor, Fn fn) const;

  std::vector<TensorInfo> tensors_;
  std::vector<GroupConfig> groups_;
  std::vector<Subgroup> subgroups_;
  std::vector<void*> allocations_;
  uint64_t total_params_ = 0;
  uint64_t subgroup_size_ = 0;
  HostMemoryBudget* budget_ = nullptr;
  uint64_t reserved_bytes_ = 0;
  std::unique_ptr<ShardAttachment> attachment_;
};

}  // namespace dos
