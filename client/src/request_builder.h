// Validation of the C ABI's arguments and their translation into the wire
// formats: the RegisterShard request (gRPC) and the control block's
// StepRequest (shared memory).
//
// Everything here is a pure function of its arguments, so the argument checks
// are unit-tested without a daemon. Messages name the offending tensor or
// group and what the caller can do.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dos/dos.h"
#include "buffer_table.h"
#include "device_memory.h"
#include "dos/wire/control_block.h"
#include "dos/wire/tensor_desc.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos::client {

// "tensor 3 ('fc1.weight')" or "tensor 3" when unnamed.
std::string TensorLabel(const dos_tensor& t, size_t index);

// The shared description of tensor `index` as it is registered (unnamed
// tensors are called "tensor<index>"). The caller has checked its dtypes.
TensorDesc DescribeTensor(const dos_tensor& t, size_t index);

// The wire form of a group's hyperparameters; checked, like every entry
// point's, by ValidateGroupStepParams (dos/wire/hparams.h).
GroupStepParams StepParams(const dos_hparams& h);

// Checks every tensor and group and resolves each param/grad pointer: first
// through `buffers` (shared memory), then, when `device` is given, as CUDA
// device memory (a CUDA IPC location). Every tensor of one request must be
// of one kind. The result's session field is left for the caller.
absl::StatusOr<v1::RegisterShardRequest> BuildRegisterRequest(
    absl::Span<const dos_tensor> tensors, absl::Span<const dos_hparams> groups,
    uint64_t subgroup_size, const BufferTable& buffers, DeviceMemory* device = nullptr);

// Checks `args` against the number of registered groups and tensors and
// fills `out` (everything but seq).
absl::Status FillStepRequest(const dos_step_args& args, size_t registered_groups,
                             size_t registered_tensors, StepRequest* out);
// The skip mask alone (`out->skip`, kStepSkipTensors in `out->flags` when
// any tensor is skipped), checked against the registered tensors.
absl::Status FillSkipMask(const dos_step_args& args, size_t registered_tensors,
                          StepRequest* out);

}  // namespace dos::client
