// ShardSpec: the tensors and param groups a trainer registers, as the rpc
// layer hands them to the session, and the checks on them that need no
// daemon state (ValidateShardSpec): the first step of Session::Register.
//
// Thread-safety: plain data and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "dos/wire/dtype.h"
#include "dos/wire/tensor_desc.h"
#include "daemon/state/shard_state.h"
#include "daemon/transport/transport.h"

namespace dos {

// One tensor as the client registers it: its description and where the
// trainer's memory for it is.
struct TensorSpec {
  TensorDesc desc;
  MemoryRef param;
  MemoryRef grad;
};

struct ShardSpec {
  std::vector<TensorSpec> tensors;
  std::vector<GroupConfig> groups;
  uint64_t subgroup_size = 0;  // 0: the daemon's default
  StateFormat state_format = StateFormat::kFp32;
  // GPU mode, optional: the trainer's "gradients ready" cudaIpcEventHandle_t
  // (see kStepTrainerEventRecorded in control_block.h).
  std::string cuda_ipc_event;
};

// "register: tensor 3 (w) param", for errors about one tensor.
std::string TensorWhat(uint32_t index, const std::string& name, absl::string_view part);

// Longest tensor name a registration may carry (bytes): names are kept for
// the session's life (stats, checkpoints), so their size is bounded.
inline constexpr size_t kMaxTensorNameBytes = 1024;
// Bookkeeping dosd keeps per registered tensor beyond its name (its spec,
// binding, layout and summary records), charged with the name to the uid
// (--max_bookkeeping_bytes_per_uid). An estimate
// from the structures' sizes, rounded up.
inline constexpr uint64_t kBookkeepingBytesPerTensor = 512;
// INVALID_ARGUMENT for tensor `index`'s name of `bytes` past kMaxTensorNameBytes.
absl::Status CheckTensorName(uint32_t index, size_t bytes);

// INVALID_ARGUMENT naming the tensor or group and the fix when the spec
// cannot be registered: no tensors or groups (or too many groups), a group's
// hyperparameters outside torch's rules (ValidateGroupStepParams), a tensor with
// no elements or too many, a group index out of range, a misaligned offset,
// CUDA IPC and shared memory mixed, CUDA memory on more than one device, an
// IPC event with shared-memory tensors.
absl::Status ValidateShardSpec(const ShardSpec& spec);

// True when the spec's tensors are in GPU memory (CUDA IPC locations); a
// valid spec is all one or all the other.
inline bool InDeviceMemory(const ShardSpec& spec) {
  return !spec.tensors.empty() && spec.tensors[0].param.is_cuda_ipc();
}

}  // namespace dos
