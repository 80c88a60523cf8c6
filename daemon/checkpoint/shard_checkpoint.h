// SaveShard / LoadShard: a session's ShardState to and from a checkpoint file
// (CheckpointWriter / CheckpointReader), streaming straight from and into the
// subgroup allocations, so a checkpoint needs no second copy of the state.
//
// Consistency: SaveShard and LoadShard need the state held still for the
// duration (the session's mutex, between steps); they do not lock.
// SaveSnapshot writes a copy-on-write snapshot while steps go on.
//
// LoadShard is all or nothing: it checks the layout against the shard, then
// reads and verifies every checksum in the file before it writes a single
// value into the state, then reads the file again into the state. A file that
// is corrupt, truncated or of another layout leaves the state untouched. (Only
// a file modified between the two passes could fail the second one; that is
// reported as DATA_LOSS saying the state was partly overwritten.)
//
// Thread-safety: none; see above.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "daemon/checkpoint/checkpoint_format.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/checkpoint/env.h"
#include "daemon/state/shard_state.h"

namespace dos {

// Informational fields recorded in the layout (CheckpointLayout::owner...).
struct CheckpointOwner {
  std::string name;  // the client's name
  int32_t rank = -1;
  int32_t world_size = 1;
};

// The layout of `shard` as a checkpoint records it.
CheckpointLayout LayoutOf(const ShardState& shard, const CheckpointOwner& owner = {});

// FAILED_PRECONDITION naming the first field where `checkpoint` (read from
// `path`) and `shard` differ: tensor count, tensors[i].name / numel / group /
// param_dtype / grad_dtype, group count, groups[i].decoupled_weight_decay.
// Hyperparameters that schedulers change (lr, betas, eps, weight decay), the
// subgroup size and the state format may differ.
// `sides` names the two layouts in the message (a resume compares a new
// registration with the state its dead trainer left).
struct LayoutSides {
  std::string subject;  // e.g. "checkpoint P does not match the session's layout"
  absl::string_view first = "in the checkpoint";
  absl::string_view second = "in the registered shard";
  absl::string_view fix = "register the same tensors as the checkpointed run";
};
absl::Status CheckLayoutMatches(const CheckpointLayout& checkpoint, const ShardState& shard,
                                const LayoutSides& sides);
absl::Status CheckLayoutMatches(const CheckpointLayout& checkpoint, const ShardState& shard,
                                absl::string_view path);

// The size of the file SaveShard writes for `shard` (before it writes it:
// the checkpoint quota is checked against it).
uint64_t ShardFileBytes(const ShardState& shard, const CheckpointOwner& owner = {},
                        const CheckpointWriterOptions& options = {});

// The size of the file for `layout`.
uint64_t LayoutFileBytes(const CheckpointLayout& layout,
                         const CheckpointWriterOptions& options = {});

// Writes `shard` to `path` atomically, in the shard's state format (a
// compact shard's moments are saved as bf16, as it holds them). RESOURCE_EXHAUSTED (naming the path and
// the free space) when the disk is full; any failure leaves the previous file
// at `path` intact.
absl::Status SaveShard(const ShardState& shard, const std::string& path, Env* env,
                       const CheckpointOwner& owner = {},
                       const CheckpointWriterOptions& options = {});

// The same for the snapshot in flight on `shard` (ShardState::BeginSnapshot),
// under `layout` as taken at its step boundary (LayoutOf then: the step
// counts and hyperparameters of the boundary): each subgroup is read through
// SnapshotAcquire and let go (SnapshotReleaseBelow) as soon as the file is
// past it, so steps blocked on one wait no longer than that. The caller ends
// the snapshot afterwards, whatever this returns.
absl::Status SaveSnapshot(const CheckpointLayout& layout, ShardState& shard,
                          const std::string& path, Env* env,
                          const CheckpointWriterOptions& options = {});

// Loads `path` into `shard` (master, exp_avg, exp_avg_sq and each tensor's
// step count). The file's state format need not be the shard's: a compact
// checkpoint's bf16 moments widen exactly into fp32 state; an fp32
// checkpoint's moments round to nearest even bf16 in compact state. DATA_LOSS for a corrupt or truncated file, FAILED_PRECONDITION
// for a layout mismatch, NOT_FOUND for a missing file; the state is untouched
// in every one of those cases.
absl::Status LoadShard(ShardState* shard, const std::string& path, Env* env);

}  // namespace dos
