// Copies between GPU memory and page-locked host memory done by a kernel
// (the SMs load and store across PCIe) instead of the copy engines.
//
// The CPU path of a GPU step moves small pieces (a subgroup's gradients to
// the host, its new weights back) while the GPU path streams whole
// subgroups' state (1.2 GB a piece at 100M parameters) through the copy
// engines in both directions. A copy engine serves one stream's queued
// copies while that stream has work, and stream priorities do not apply to
// copies (CUDA's documentation), so the CPU path's copies waited behind
// several state copies: on nvidia-h200 at 6B, 70-100 ms per step with the
// CPU idle (bench/e2e/README.md). A kernel's loads and stores share the
// PCIe link with the copy engines but wait in no copy queue.
//
// `host` pointers must be page-locked memory from cudaHostAlloc (device
// accessible under unified addressing); `device` pointers device memory of
// the current device (CUDA IPC mappings included). Any alignment: the
// widest access (16, 8, 4, 2 or 1 bytes) that both ends and the size allow.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace dos::gpu {

// Enqueues a copy of `bytes` from `src` to `dst` on `stream`, one of them
// in page-locked host memory (or both in device memory).
absl::Status LaunchPcieCopy(void* dst, const void* src, uint64_t bytes, cudaStream_t stream);

}  // namespace dos::gpu
