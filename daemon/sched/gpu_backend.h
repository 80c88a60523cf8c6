// GpuBackend: what the step executor needs from a GPU engine, without CUDA
// in its headers (dos_sched builds in CPU-only CI; daemon/gpu implements it
// as gpu::GpuEngine when DOS_WITH_CUDA is on and a GPU is present).
//
// Ownership: the engine outlives every session and executor that uses it.
// Thread-safety: every method is thread-safe; Update calls for shards on
// the same device are serialised inside the engine (they share its streams,
// staging slots and DMA engines).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cpu/adam_kernel.h"
#include "daemon/sched/policy.h"
#include "daemon/state/register_progress.h"
#include "daemon/state/shard_state.h"
#include "daemon/transport/transport.h"

namespace dos {

struct TensorBinding;
struct StepOutcome;
struct StepSync;

class GpuBackend {
 public:
  virtual ~GpuBackend() = default;

  // A transport that maps CUDA IPC locations on this engine's device.
  virtual std::unique_ptr<Transport> NewTransport() = 0;
  // Synchronous copies between host memory and (IPC-mapped) device memory.
  virtual absl::Status CopyToHost(void* dst, const void* device_src, uint64_t bytes) = 0;
  virtual absl::Status CopyToDevice(void* device_dst, const void* src, uint64_t bytes) = 0;
  // Page-locks the shard's host state (cudaHostRegister) so that the DMA
  // engines read and write it directly; the registration is attached to the
  // shard and undone when the shard is freed. Once per shard, at registration;
  // reports phase kRegisterPinning to `progress` (may be null).
  virtual absl::Status AttachShard(ShardState& shard, RegisterProgress* progress) = 0;
  // Opens the trainer's "gradients ready" event from its cudaIpcEventHandle_t
  // bytes (RegisterShard's cuda_ipc_event); INVALID_ARGUMENT for a handle of
  // the wrong size or one CUDA refuses. CloseTrainerEvent releases it.
  virtual absl::StatusOr<void*> OpenTrainerEvent(const std::string& handle) = 0;
  virtual void CloseTrainerEvent(void* event) = 0;
  // Makes every stream of the engine wait (on the GPU, not the host) for the
  // event's most recent record: work enqueued afterwards sees the gradients.
  virtual absl::Status WaitTrainerEvent(void* event) = 0;
  // True when every gradient of every tensor is finite (a scan on the GPU).
  virtual absl::StatusOr<bool> AllFinite(const ShardState& shard,
                                         std::span<const TensorBinding> bindings) = 0;
  // Updates every subgroup of the shard under `policy`, on the GPU and the
  // CPU, and fills the placement and timing fields of `out`. `scalars` has
  // one entry per tensor. Trainer weights are written in place; when it
  // returns, every copy and kernel of the step has completed.
  // `sync.subgroup_done` is called per subgroup as its weights land.
  virtual absl::Status Update(ShardState& shard, std::span<const TensorBinding> bindings,
                              std::span<const cpu::AdamScalars> scalars, const Policy& policy,
                              const StepSync& sync, StepOutcome* out) = 0;
  // Copies state kept resident on the GPU back to the host arrays (before
  // reading the state out), and forgets resident copies (after the host
  // state was replaced).
  virtual absl::Status SyncResidentToHost(ShardState& shard) = 0;
  virtual void DropResident(ShardState& shard) = 0;
};

}  // namespace dos
