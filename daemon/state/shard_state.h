// ShardState: the optimizer state that the daemon holds for one session's
// shard (the tensors one trainer rank registered), in the session's
// StateFormat (state_format.h): fp32 master with fp32 or bf16 moments.
//
// The shard's tensors are laid end to end in one flat element space, which is
// cut into subgroups of at most `subgroup_size` elements: the unit that the
// scheduler places on the CPU or the GPU each step. A subgroup may span tensor
// boundaries; its segments say which run of which tensor it covers. Each
// subgroup's master weights, exp_avg and exp_avg_sq are one allocation, laid
// out [master | exp_avg | exp_avg_sq], so the GPU path can move a subgroup's
// whole state with one copy each way (numel * 12 bytes in fp32 format,
// numel * 8 in compact format: the moments are then numel bf16 each).
//
// Copy-on-write snapshots: a checkpoint is written from a step boundary
// while steps go on, straight from the state, with no second copy of it.
// BeginSnapshot (under the owner's lock, between steps) only marks every
// subgroup "pending"; the checkpointer's thread then reads the subgroups in
// order (SnapshotAcquire) and lets each go once written
// (SnapshotReleaseBelow, EndSnapshot). Whatever writes a subgroup's host
// state calls BeforeWrite(subgroup) first: a pending subgroup is copied into
// a buffer of the snapshot's SnapshotPool then and there (the writer reads
// the copy), or, when the pool is spent, waited for until the writer has let
// it go; one the writer is reading in place is waited for (the file keeps a
// tensor's subgroups until all three of its sections are written). So the file is
// bitwise the state at the boundary, and a save holds at most the pool's
// limit beside the state. With no snapshot in flight BeforeWrite is one
// atomic load.
//
// Ownership: ShardState owns the state memory and returns its bytes to the
// HostMemoryBudget on destruction. Thread-safety: none for the state itself;
// the owning Session serialises steps and state transfers. The snapshot
// methods are thread-safe as described at each; BeforeWrite may be called
// from several threads of one step for different subgroups.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/state/host_arena.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/state/register_progress.h"
#include "daemon/state/snapshot_pool.h"
#include "daemon/state/state_format.h"
#include "dos/wire/dtype.h"
#include "dos/wire/step_params.h"
#include "dos/wire/tensor_desc.h"

namespace dos {

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
  StateFormat format = StateFormat::kFp32;
  float* master = nullptr;      // numel each, back to back in one allocation
  float* exp_avg = nullptr;     // fp32 format; null in compact format
  float* exp_avg_sq = nullptr;
  uint16_t* exp_avg_bf16 = nullptr;     // compact format; null in fp32 format
  uint16_t* exp_avg_sq_bf16 = nullptr;
  // Bytes of [master | exp_avg | exp_avg_sq] (what one copy of the whole
  // subgroup's state moves).
  uint64_t state_bytes() const { return numel * StateBytesPerParam(format); }
};

// Per-shard resources an engine attaches (page-locked registrations of the
// state, resident GPU copies): destroyed before the state memory is freed.
class ShardAttachment {
 public:
  virtual ~ShardAttachment() = default;
};

// How ShardState::Create allocates the state.
struct StateAllocOptions {
  StateFormat format = StateFormat::kFp32;  // the layout of each subgroup's state
  bool huge_pages = true;                // HostArena::Options::huge_pages
  RegisterProgress* progress = nullptr;  // phase kRegisterAllocating; may be null
};

class ShardState {
 public:
  // Bytes of state per parameter in the widest format (fp32 master,
  // exp_avg, exp_avg_sq): what a buffer that must hold any session's
  // subgroup reserves. A shard's own figure is bytes_per_param().
  static constexpr uint64_t kStateBytesPerParam = StateBytesPerParam(StateFormat::kFp32);
  // Bytes of the one page-aligned allocation holding a subgroup of `numel`
  // parameters' state (what an engine page-locks).
  static constexpr uint64_t kAllocationAlignment = 4096;
  static constexpr uint64_t AllocationBytes(uint64_t numel,
                                            StateFormat format = StateFormat::kFp32) {
    return (numel * StateBytesPerParam(format) + kAllocationAlignment - 1) /
           kAllocationAlignment * kAllocationAlignment;
  }

  // Lays out `tensors`, reserves the state's bytes from `budget` (which must
  // outlive the ShardState) and allocates it, zeroed and faulted in from all
  // cores (HostArena). `what` names the registration in error messages.
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(std::vector<TensorDesc> tensors,
                                                            std::vector<GroupConfig> groups,
                                                            uint64_t subgroup_size,
                                                            HostMemoryBudget* budget,
                                                            absl::string_view what,
                                                            const StateAllocOptions& alloc = {});
  ~ShardState();
  ShardState(const ShardState&) = delete;
  ShardState& operator=(const ShardState&) = delete;

  // The tensors in registration order; a step advances their `step`.
  std::span<TensorDesc> tensors() { return tensors_; }
  std::span<const TensorDesc> tensors() const { return tensors_; }
  // Where tensor `tensor`'s first element lies in the flat element space.
  uint64_t flat_offset(uint32_t tensor) const { return flat_offsets_[tensor]; }
  std::span<const GroupConfig> groups() const { return groups_; }
  std::span<Subgroup> subgroups() { return subgroups_; }
  std::span<const Subgroup> subgroups() const { return subgroups_; }
  uint64_t total_params() const { return total_params_; }
  uint64_t subgroup_size() const { return subgroup_size_; }
  StateFormat format() const { return format_; }
  uint64_t bytes_per_param() const { return StateBytesPerParam(format_); }
  uint64_t state_bytes() const { return total_params_ * bytes_per_param(); }
  // Host memory a shard of `params` in subgroups of `subgroup_size` really
  // takes: each subgroup's arrays are one page-aligned allocation (1024
  // elements fill 3 pages exactly in fp32 format, 2 in compact). This, not
  // state_bytes(), is charged to the budget.
  static uint64_t AllocatedBytes(uint64_t params, uint64_t subgroup_size,
                                 StateFormat format = StateFormat::kFp32);

  // Map alignment: when the subgroup size is a multiple of kMapAlignElems and
  // the shard has at least kMapAlignMinParams parameters, every tensor of at
  // least kMapAlignMinNumel elements starts at a multiple of kMapAlignElems in
  // the flat space (at most 2047 elements of padding each, in no segment), and
  // the flat space ends on one. Each of such a tensor's runs then starts on a
  // page of every state array (fp32 and bf16), so its owner can map each of
  // its arrays as one contiguous read-only view (StateMemoryLayout).
  static constexpr uint64_t kMapAlignElems = 2048;
  static constexpr uint64_t kMapAlignMinNumel = uint64_t{1} << 16;
  static constexpr uint64_t kMapAlignMinParams = uint64_t{1} << 20;
  // Subgroup sizes of at least this many elements are rounded up to a
  // multiple of kMapAlignElems by the session (a change of at most 3.1%).
  static constexpr uint64_t kMapAlignMinSubgroup = uint64_t{1} << 16;
  // The flat element space, padding included (subgroups cut it).
  uint64_t flat_size() const { return flat_size_; }

  // Copies `n` elements of one state array of `tensor`, starting at
  // `tensor_offset`, out of (Read) or into (Write) `buf`. `which` is 0 for
  // master, 1 for exp_avg, 2 for exp_avg_sq. `buf` is fp32 whatever the
  // format: compact moments are widened exactly on the way out and rounded
  // to nearest even bf16 on the way in (both moments: an import is not a
  // step, so there is no running average for stochastic rounding to keep
  // unbiased, and nearest is deterministic).
  void ReadTensor(uint32_t tensor, int which, float* buf) const;
  void WriteTensor(uint32_t tensor, int which, const float* buf);
  // The same for elements [offset, offset + n) of the tensor only (the
  // caller checks that the range lies inside it); buf holds n elements.
  void ReadTensorRange(uint32_t tensor, int which, uint64_t offset, uint64_t n, float* buf) const;
  void WriteTensorRange(uint32_t tensor, int which, uint64_t offset, uint64_t n, const float* buf);

  // Copy-on-write snapshot (see the top of this file). BeginSnapshot: the
  // caller holds the lock that serialises writers (a step boundary); steps
  // copy into `pool`'s buffers (null: they wait for the writer instead),
  // which outlives EndSnapshot. A snapshot still in flight must have ended.
  void BeginSnapshot(SnapshotPool* pool);
  // The writer's side, one thread, in increasing subgroup order: the
  // boundary's state of `subgroup` until SnapshotReleaseBelow passes it: a
  // step's copy, else the live state, which steps then leave alone.
  const Subgroup& SnapshotAcquire(uint32_t subgroup);
  // The writer is done with every subgroup below `end`: steps may write them
  // (a copy's buffer goes back to the pool).
  void SnapshotReleaseBelow(uint32_t end);
  // Releases the rest and ends the snapshot (also after a failed write);
  // returns how many subgroups steps copied for it. No-op when none is in
  // flight.
  uint32_t EndSnapshot();
  // Under the owner's lock, before writing the whole state (state import,
  // checkpoint load): BeforeWrite for every subgroup (a copy, or a wait for
  // the writer where the pool is spent). The snapshot stays in flight until
  // its writer ends it.
  void ProtectSnapshot() { BeforeWritesFrom(0); }
  // BeforeWrite for each of `subgroups`, or every subgroup from `from` on,
  // last first: the writer goes first to last, and a loop going its way would
  // trail it, waiting at each subgroup it reads and copying none. Callers
  // that must not wait under a lock of their own call these before taking it.
  void BeforeWrites(std::span<const uint32_t> subgroups);
  void BeforeWritesFrom(uint32_t from);
  bool snapshot_in_progress() const { return snapshot_active_.load(std::memory_order_acquire); }
  // Call before writing subgroup `subgroup`'s host state (master, exp_avg,
  // exp_avg_sq) while a snapshot may be in flight.
  void BeforeWrite(uint32_t subgroup) {
    if (snapshot_active_.load(std::memory_order_acquire)) CopyBeforeWrite(subgroup);
  }
  // Microseconds writers spent in BeforeWrite copying or waiting for a
  // snapshot (the copy-on-write stall) since the last call; resets it.
  double TakeWriteWaitUs();

  // The owner's zero-copy view (fdproto::Op::kStateMemory): a read-only
  // descriptor of the state's memfd and a sealed memfd holding the state map
  // (dos/wire/state_map.h) of every tensor's runs and step count now. The
  // caller makes sure the host state is current (resident subgroups synced).
  struct StateMemory {
    UniqueFd state;
    UniqueFd map;
  };
  absl::StatusOr<StateMemory> ExportStateMemory() const;
  // The owner uid's state-views charge (UidResource::kStateViews), taken by
  // the session at the first export. When the shard is destroyed while its
  // owner may still map the memory, the charge and the state's bytes stay
  // held in the budget until nothing views it (HostMemoryBudget::HoldWhileViewed).
  bool views_charged() const { return views_charge_.amount() != 0; }
  void set_views_charge(LedgerCharge charge) { views_charge_ = std::move(charge); }
  // The owner uid's charge for this state's bytes (UidResource::kStateBytes),
  // held with the bytes while the state lives, or is still viewed after it.
  void set_state_charge(LedgerCharge charge) { state_charge_ = std::move(charge); }

  // The state's memory: subgroup i's state is arena().slot(i).
  const HostArena& arena() const { return *arena_; }

  // Where tensor `tensor`'s fp32 masters live: runs of `count` elements from
  // `tensor_offset` at `master`, in order (for filling them in place).
  // `moments` is the same run's moment bytes: at least count * 4 bytes from
  // there lie inside the subgroup's allocation (exp_avg and, in compact
  // format, exp_avg_sq after it), zero while the state is fresh: room to
  // stage count weights of up to 4 bytes each.
  struct MasterRun {
    float* master;
    void* moments;
    uint64_t tensor_offset;
    uint64_t count;
    uint32_t subgroup;
  };
  std::vector<MasterRun> MasterRuns(uint32_t tensor);

  // Calls fn(subgroup, segment) for every segment covering `tensor`, in
  // tensor order (the one walk from a tensor to its runs in the subgroups).
  template <typename Fn>
  void ForEachRun(uint32_t tensor, Fn fn) const {
    const uint64_t begin = flat_offsets_[tensor];
    const uint64_t end = begin + tensors_[tensor].numel;
    for (uint64_t gi = begin / subgroup_size_; gi < subgroups_.size(); ++gi) {
      const Subgroup& g = subgroups_[gi];
      if (g.flat_begin >= end) break;
      // A subgroup's segments are in tensor order (the flat layout): found
      // by bisection, so a registration of n tiny tensors in one subgroup
      // walks n log n segments, not n^2.
      auto seg = std::lower_bound(
          g.segments.begin(), g.segments.end(), tensor,
          [](const SubgroupSegment& s, uint32_t t) { return s.tensor < t; });
      for (; seg != g.segments.end() && seg->tensor == tensor; ++seg) fn(g, *seg);
    }
  }

  // The GPU engine's per-shard resources (null in CPU mode).
  ShardAttachment* attachment() const { return attachment_.get(); }
  void set_attachment(std::unique_ptr<ShardAttachment> a) { attachment_ = std::move(a); }

 private:
  ShardState() = default;
  void CopyBeforeWrite(uint32_t subgroup);
  // Copies subgroup `i` into a pool buffer if there is room and its state
  // is still `*seen` (kPending); else false with `*seen` as found.
  bool CopyForSnapshot(uint32_t i, uint32_t* seen);
  void ReleaseForSnapshot(uint32_t subgroup);

  // Per subgroup, for the snapshot in flight: kReleased once the writer is
  // done with it (or none is in flight); kPending until the writer or a
  // step takes it; kReading while the writer reads the live state; kCopying
  // then kCopied when a step copied it into a pool buffer first.
  enum CopyState : uint32_t {
    kReleased = 0,
    kPending = 1,
    kCopying = 2,
    kCopied = 3,
    kReading = 4
  };
  struct SnapshotCopy {
    SnapshotPool::Buffer buffer;
    Subgroup view;  // its arrays in `buffer` (no segments)
  };

  std::vector<TensorDesc> tensors_;
  std::vector<uint64_t> flat_offsets_;  // per tensor
  std::vector<GroupConfig> groups_;
  std::vector<Subgroup> subgroups_;
  std::unique_ptr<HostArena> arena_;
  uint64_t total_params_ = 0;  // sum of the tensors' elements
  uint64_t flat_size_ = 0;     // total_params_ plus map-alignment padding
  uint64_t subgroup_size_ = 0;
  StateFormat format_ = StateFormat::kFp32;
  HostMemoryBudget* budget_ = nullptr;
  uint64_t reserved_bytes_ = 0;
  LedgerCharge views_charge_;
  LedgerCharge state_charge_;
  std::unique_ptr<ShardAttachment> attachment_;

  // Snapshot state. `snapshot_pool_` is written by BeginSnapshot only (a
  // step boundary, under the owner's lock) and read by steps after they
  // observe `snapshot_active_`; a copy is published by the release store of
  // kCopied into its `copy_state_`, and given back by the writer only.
  std::atomic<bool> snapshot_active_{false};
  SnapshotPool* snapshot_pool_ = nullptr;
  std::unique_ptr<std::atomic<uint32_t>[]> copy_state_;  // CopyState per subgroup
  std::vector<SnapshotCopy> snapshot_copies_;            // per subgroup
  uint32_t snapshot_released_ = 0;  // writer only: subgroups below are released
  std::atomic<uint32_t> copied_by_writers_{0};
  std::atomic<uint64_t> write_wait_ns_{0};
};

}  // namespace dos
