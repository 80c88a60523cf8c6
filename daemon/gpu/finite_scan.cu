#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "daemon/gpu/cuda_check.h"
#include "daemon/gpu/finite_scan.h"
#include "dos/wire/status_macros.h"

namespace dos::gpu {
namespace {

constexpr int kThreads = 256;
// Tensors per launch: their descriptors fill the kernel's parameter space
// (4 KiB) short of the count.
constexpr int kScanBatch = 128;
// Enough blocks per tensor to keep every SM's loads in flight (132 SMs on
// an H100 or H200); the grid-stride loop covers larger tensors.
constexpr uint64_t kMaxBlocks = 132 * 8;
constexpr int kUnroll = 4;

struct ScanEntry {
  const char* bytes;
  uint64_t size;  // bytes
  uint32_t mask;  // the exponent bits of every element of one 32-bit word
  uint32_t elem;  // element size: 2 or 4
};

struct ScanBatch {
  ScanEntry t[kScanBatch];
};
static_assert(sizeof(ScanBatch) <= 4000, "the batch must fit the kernel's parameters");

// A word's element is inf or NaN when all its exponent bits are set; a word
// of two 16-bit elements is tested per half.
__device__ __forceinline__ bool BadWord(uint32_t w, uint32_t mask, bool half) {
  return half ? __vcmpeq2(w & mask, mask) != 0 : (w & mask) == mask;
}

__device__ __forceinline__ bool BadVec(const uint4& v, uint32_t mask, bool half) {
  return BadWord(v.x, mask, half) | BadWord(v.y, mask, half) | BadWord(v.z, mask, half) |
         BadWord(v.w, mask, half);
}

__device__ __forceinline__ bool BadElement(const char* p, uint32_t mask, bool half) {
  if (half) {
    const uint32_t m = mask & 0xffffu;
    return (*reinterpret_cast<const uint16_t*>(p) & m) == m;
  }
  return (*reinterpret_cast<const uint32_t*>(p) & mask) == mask;
}

// blockIdx.y: the tensor; blockIdx.x: its share of the 16-byte words.
__global__ void NonFiniteBatchKernel(const ScanBatch batch, int* flag) {
  const ScanEntry e = batch.t[blockIdx.y];
  const bool half = e.elem == 2;
  const uint64_t misalign = reinterpret_cast<uintptr_t>(e.bytes) & 15u;
  const uint64_t align = (16 - misalign) & 15u;
  const uint64_t head = align < e.size ? align : e.size;
  const uint64_t vecs = (e.size - head) / 16;
  const uint64_t tail = head + vecs * 16;
  const uint64_t edge_elems = (head > e.size - tail ? head : e.size - tail) / e.elem;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x;
  // Whole blocks past this tensor's work leave at once (a small tensor
  // shares the launch's grid with the largest of its batch).
  if (first >= vecs && first >= edge_elems) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint4* v = reinterpret_cast<const uint4*>(e.bytes + head);
  bool bad = false;
  uint64_t i = first + threadIdx.x;
  // Independent loads in flight per thread: the scan is bound by memory.
  for (; i + (kUnroll - 1) * stride < vecs; i += kUnroll * stride) {
    uint4 r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = __ldcs(v + i + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) bad |= BadVec(r[k], e.mask, half);
  }
  for (; i < vecs; i += stride) bad |= BadVec(__ldcs(v + i), e.mask, half);
  const uint64_t j = first + threadIdx.x;  // the unaligned head's and tail's elements
  if (j < head / e.elem) bad |= BadElement(e.bytes + j * e.elem, e.mask, half);
  if (j < (e.size - tail) / e.elem) bad |= BadElement(e.bytes + tail + j * e.elem, e.mask, half);
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

ScanEntry EntryOf(const ScanTensor& t) {
  switch (t.dtype) {
    case DType::kF32:
      return {static_cast<const char*>(t.grad), t.n * 4, 0x7f800000u, 4};
    case DType::kBF16:
      return {static_cast<const char*>(t.grad), t.n * 2, 0x7f807f80u, 2};
    case DType::kF16:
      return {static_cast<const char*>(t.grad), t.n * 2, 0x7c007c00u, 2};
  }
  return {static_cast<const char*>(t.grad), t.n * 4, 0x7f800000u, 4};
}

}  // namespace

absl::Status LaunchNonFiniteScan(const ScanTensor* tensors, size_t count, int* flag,
                                 cudaStream_t stream) {
  ScanBatch batch{};
  unsigned used = 0;
  uint64_t blocks = 1;
  auto launch = [&]() -> absl::Status {
    if (used == 0) return absl::OkStatus();
    NonFiniteBatchKernel<<<dim3(static_cast<unsigned>(blocks), used), kThreads, 0, stream>>>(batch,
                                                                                             flag);
    used = 0;
    blocks = 1;
    return DOS_CUDA_STATUS(cudaGetLastError());
  };
  for (size_t k = 0; k < count; ++k) {
    if (tensors[k].n == 0) continue;
    const ScanEntry e = EntryOf(tensors[k]);
    const uint64_t words = e.size / 16;  // the head's and tail's few elements: block 0
    blocks = std::max(blocks, std::min(kMaxBlocks, (words + kThreads - 1) / kThreads));
    batch.t[used++] = e;
    if (used == kScanBatch) DOS_RETURN_IF_ERROR(launch());
  }
  return launch();
}

}  // namespace dos::gpu
