#include "daemon/gpu/pcie_copy.h"

#include <algorithm>

#include "daemon/gpu/cuda_check.h"

namespace dos::gpu {
namespace {

constexpr int kThreads = 256;
// A few SMs, not the whole GPU: each block lives for the whole copy (a
// grid-stride loop waiting on PCIe), and the copies run through most of an
// update, so a grid of every SM kept the trainer's next forward (and the
// resident subgroups' kernels) off the GPU for the whole step (measured at
// 6B on nvidia-h200 with 528 blocks: the forward overlapped nothing of the
// update, and the resident kernels took 80 ms instead of 60). 24 blocks of
// 256 threads with 8 loads of 16 bytes in flight each keep 768 KiB in
// flight, several times what PCIe's latency at its full rate needs.
constexpr int kMaxBlocks = 24;
constexpr int kUnroll = 8;

template <typename T>
__global__ void CopyKernel(T* __restrict__ dst, const T* __restrict__ src, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    T v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[i + k * stride] = v[k];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

template <typename T>
absl::Status Launch(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
  const uint64_t n = bytes / sizeof(T);
  const uint64_t want = (n + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const int blocks = static_cast<int>(std::clamp<uint64_t>(want, 1, kMaxBlocks));
  CopyKernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst),
                                                 static_cast<const T*>(src), n);
  return DOS_CUDA_STATUS(cudaGetLastError());
}

}  // namespace

absl::Status LaunchPcieCopy(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
  const uint64_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if (a % 16 == 0) return Launch<uint4>(dst, src, bytes, stream);
  if (a % 8 == 0) return Launch<uint2>(dst, src, bytes, stream);
  if (a % 4 == 0) return Launch<uint32_t>(dst, src, bytes, stream);
  if (a % 2 == 0) return Launch<uint16_t>(dst, src, bytes, stream);
  return Launch<uint8_t>(dst, src, bytes, stream);
}

}  // namespace dos::gpu
