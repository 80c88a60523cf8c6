// The delayed host path's CPU part (daemon/sched/delayed_host.h), the same
// for every engine: the CPU kernel over the captured gradients of a
// DelayedHost into the shard's host state, the new weights into its buffers.
//
// Thread-safety: as CpuUpdater::Run; the caller holds the session's step lock.
#pragma once

#include "absl/status/status.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/sched/delayed_host.h"
#include "daemon/sched/engine.h"
#include "daemon/state/shard_state.h"

namespace dos::cpu {

// Updates every captured subgroup of `delayed` with its scalars (copying
// each for a checkpoint in progress first: ShardState::BeforeWrite); adds
// the kernel's time to `*kernel_us`. INTERNAL when a captured subgroup is
// resident-sized wrong (a plan that delayed a subgroup the shard lacks).
absl::Status UpdateDelayed(CpuUpdater* cpu, ShardState& shard, const DelayedHost& delayed,
                           double* kernel_us);

// Copies between the trainer's memory (host-addressable: shared memory) and
// `delayed`'s buffers: without `capture`, the pending weights of
// `subgroups` into the trainer's parameters; with it, their gradients into
// the buffers (but for those captured during backward already:
// DelayedHost::captured_early), after the weights of those the step
// installs (DelayedHost::installs).
absl::Status CopyDelayedHost(const ShardState& shard, std::span<const TensorBinding> bindings,
                             const DelayedHost& delayed, std::span<const uint32_t> subgroups,
                             bool capture);

}  // namespace dos::cpu
