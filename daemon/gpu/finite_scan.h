// The GPU path's non-finite scan: whether any gradient of a step is inf or
// NaN, before anything is applied (a step with one is skipped whole).
//
// One launch covers up to kScanBatch tensors (their pointers travel in the
// kernel's parameters), and each tensor is read 16 bytes at a time between
// an unaligned head and tail: the scan is a read of every gradient byte on
// the step's critical path (about 13 GB at 7B in bf16), so it must run at
// the memory's speed, not at a launch and a 2-byte load per element.
//
// Thread-safety: launches are asynchronous on the given stream; the caller
// orders them after the trainer's gradients with an event.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "dos/wire/dtype.h"

namespace dos::gpu {

// One tensor's gradient: device memory (CUDA IPC mapped or the daemon's own),
// aligned to its element size.
struct ScanTensor {
  const void* grad;
  DType dtype;
  size_t n;
};

// ORs 1 into *flag (device memory, int) if any element of the `count`
// tensors is inf or NaN (any sign, any payload); leaves it otherwise.
absl::Status LaunchNonFiniteScan(const ScanTensor* tensors, size_t count, int* flag,
                                 cudaStream_t stream);

}  // namespace dos::gpu
