// finite_scan_bench: the GPU path's non-finite scan over the gradients of a
// 7B Llama (291 bf16 tensors, 13.5 GB; the shapes of the HF 7B job), on
// random finite data, after warm-up, median of 20:
//   batched: LaunchNonFiniteScan (daemon/gpu/finite_scan.h), what dosd runs;
//   per_tensor: the kernel it replaced (one launch per tensor, one 2-byte
//     load per element and thread), kept here as the baseline;
//   bound: the same bytes read at the device's measured copy bandwidth (a
//     device-to-device copy of them reads and writes each byte once).
// Prints one JSON object (bench/results/finite_scan_<machine>_<date>.json).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#include "daemon/gpu/finite_scan.h"

namespace {
#define CK(x)                                                       \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                 \
    }                                                               \
  } while (0)

__global__ void PerTensorKernel(const uint16_t* __restrict__ grad, size_t n, int* flag) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    bad |= (grad[i] & 0x7f80u) == 0x7f80u;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

// Random finite bf16: any sign and mantissa, exponent below all-ones.
__global__ void FillKernel(uint16_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const uint16_t exp = static_cast<uint16_t>(0x30 + (x >> 8) % 0x4f);  // 2^-79 .. 2^-1
    p[i] = static_cast<uint16_t>((x & 0x8000u) | (exp << 7) | (x & 0x7fu));
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main() {
  CK(cudaSetDevice(0));
  // Llama 7B: embed and lm_head 32000x4096, 32 layers of q/k/v/o 4096^2,
  // gate/up/down 4096x11008 and two norms, the final norm.
  std::vector<size_t> numel = {32000ull * 4096};
  for (int l = 0; l < 32; ++l) {
    for (int k = 0; k < 4; ++k) numel.push_back(4096ull * 4096);
    for (int k = 0; k < 3; ++k) numel.push_back(4096ull * 11008);
    numel.push_back(4096);
    numel.push_back(4096);
  }
  numel.push_back(4096);
  numel.push_back(32000ull * 4096);
  size_t total = 0;
  for (size_t n : numel) total += n;
  uint16_t* grads = nullptr;
  CK(cudaMalloc(&grads, total * 2 + 256 * numel.size()));
  std::vector<dos::gpu::ScanTensor> tensors;
  size_t at = 0;
  for (size_t n : numel) {  // each tensor 256-byte aligned, as torch's allocator places them
    tensors.push_back({grads + at, dos::DType::kBF16, n});
    at = (at + n + 127) / 128 * 128;
  }
  FillKernel<<<1024, 256>>>(grads, at, static_cast<uint64_t>(std::time(nullptr)));
  uint16_t* copy = nullptr;
  CK(cudaMalloc(&copy, total * 2));
  int* flag = nullptr;
  CK(cudaMalloc(&flag, sizeof(int)));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto time = [&](auto&& body) {
    std::vector<double> ms;
    for (int r = 0; r < 23; ++r) {
      CK(cudaMemset(flag, 0, sizeof(int)));
      CK(cudaEventRecord(a));
      body();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      if (r >= 3) ms.push_back(t);  // after warm-up
    }
    return Median(ms);
  };
  const double batched = time([&] {
    if (!dos::gpu::LaunchNonFiniteScan(tensors.data(), tensors.size(), flag, nullptr).ok()) {
      std::exit(3);
    }
  });
  int found = -1;
  CK(cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost));
  const double per_tensor = time([&] {
    for (const auto& t : tensors) {
      const size_t want = (t.n + 255) / 256;
      PerTensorKernel<<<static_cast<unsigned>(std::min<size_t>(want, 132 * 16)), 256>>>(
          static_cast<const uint16_t*>(t.grad), t.n, flag);
    }
  });
  const double copy_ms =
      time([&] { CK(cudaMemcpyAsync(copy, grads, total * 2, cudaMemcpyDeviceToDevice)); });
  const double bytes = total * 2.0;
  const double bound_ms = copy_ms / 2;  // reads the bytes once, without the copy's writes
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "{\"device\": \"%s\", \"tensors\": %zu, \"bytes\": %.0f, \"found_nonfinite\": %d,\n"
      " \"scan_ms_batched\": %.3f, \"scan_ms_per_tensor\": %.3f, \"bound_ms\": %.3f,\n"
      " \"scan_tbps_batched\": %.3f, \"scan_tbps_per_tensor\": %.3f, \"copy_tbps\": %.3f,\n"
      " \"speedup\": %.2f, \"batched_of_bound\": %.2f}\n",
      prop.name, tensors.size(), bytes, found, batched, per_tensor, bound_ms,
      bytes / batched * 1e-9, bytes / per_tensor * 1e-9, 2 * bytes / copy_ms * 1e-9,
      per_tensor / batched, bound_ms / batched);
  std::fprintf(stderr,
               "non-finite scan, 7B bf16 gradients (%zu tensors, %.1f GB): batched %.2f ms, "
               "per-tensor %.2f ms (%.2fx); bound (device copy bandwidth, reads only) %.2f ms\n",
               tensors.size(), bytes * 1e-9, batched, per_tensor, per_tensor / batched, bound_ms);
  return found == 0 ? 0 : 4;
}
