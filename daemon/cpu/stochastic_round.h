// The compact state's stochastic rounding of v (exp_avg_sq) to bf16: the
// random bits of one element and the rounding that uses them. Why v is
// rounded stochastically and what the bits depend on: adam_kernel.h.
//
// This is the one definition: the CPU kernels (adam_scalar.cc, and the
// per-step seed in adam_scalars.cc) and the GPU kernel (daemon/gpu/
// adam_kernel.cu, compiled by nvcc, where these are __host__ __device__)
// call it, so the CPU's and the GPU's bf16 moments agree bit for bit. The
// AVX2 and AVX-512 kernels compute the same function 8 or 16 lanes at a time
// from the constants below; tests/unit/cpu/stochastic_round_test checks them
// against these on random inputs, and pins a few values so that a change of
// the function (which would change every compact checkpoint's future) shows.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DOS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DOS_HOST_DEVICE inline
#endif

namespace dos::cpu {

// murmur3's 32-bit finaliser over index * golden ratio + seed.
inline constexpr uint32_t kRoundingIndexMul = 0x9e3779b1u;  // 2^32 / golden ratio
inline constexpr uint32_t kRoundingMix1 = 0x85ebca6bu;
inline constexpr uint32_t kRoundingMix2 = 0xc2b2ae35u;

// 16 random bits (0 .. 0xffff) for element `index` (its offset within its
// tensor; only the low 32 bits count) at the step whose seed is `seed`.
DOS_HOST_DEVICE uint32_t RoundingBits(uint32_t seed, uint64_t index) {
  uint32_t h = static_cast<uint32_t>(index) * kRoundingIndexMul + seed;
  h ^= h >> 16;
  h *= kRoundingMix1;
  h ^= h >> 13;
  h *= kRoundingMix2;
  h ^= h >> 16;
  return h >> 16;
}

// Stochastic fp32 -> bf16: add 16 random bits below the kept ones and
// truncate (rounds the magnitude up with probability fraction / 2^16). NaN
// becomes a quiet NaN with its sign and top payload bits, as dtype.h's
// FloatToBF16 makes it; inf stays inf; values within one bf16 ulp of FLT_MAX
// may round to inf, as nearest rounding does above it.
DOS_HOST_DEVICE uint16_t StochasticRoundBF16(float x, uint32_t bits16) {
#if defined(__CUDA_ARCH__)
  const uint32_t u = __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + bits16) >> 16);
}

}  // namespace dos::cpu
