#include "daemon/gpu/adam_kernel.h"

#include <cuda_runtime.h>

#include "daemon/gpu/cuda_check.h"

namespace dos::gpu {
namespace {

constexpr int kThreads = 256;

// dtype.h's conversions, bit for bit, on the device.
__device__ __forceinline__ float Bf16ToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    float mag = __fmul_rn(static_cast<float>(man), 5.9604644775390625e-8f);
    return sign ? -mag : mag;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ uint16_t FloatToF16(float f) {
  uint32_t u = __float_as_uint(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) {
    float mag = __fadd_rn(__uint_as_float(a), 0.5f);
    return sign | static_cast<uint16_t>(__float_as_uint(mag) - 0x3f000000u);
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;
  return sign | static_cast<uint16_t>(a >> 13);
}

// The compact state's stochastic rounding: the CPU kernels' own functions
// (daemon/cpu/stochastic_round.h, __host__ __device__ under nvcc).
using cpu::RoundingBits;
using cpu::StochasticRoundBF16;

// Where a kernel's moments live: fp32 arrays, or (kCompact) bf16 arrays with
// the stochastic rounding's element counter.
struct Moments {
  float* m;
  float* v;
  uint16_t* m16;
  uint16_t* v16;
  uint64_t element_offset;
};

template <DType G>
__device__ __forceinline__ float LoadGrad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBF16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return F16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  }
}

// The gradient as the trainer's in-place multiply by s.grad_coef left it
// (adam_kernel.h: fp32, or rounded to nearest even into bf16).
template <DType G>
__device__ __forceinline__ float ScaledGrad(const cpu::AdamScalars& s, float g) {
  if (s.grad_coef == 1.0f) return g;
  g = __fmul_rn(g, s.grad_coef);
  if constexpr (G == DType::kBF16) g = Bf16ToFloat(FloatToBf16(g));
  return g;
}

template <DType P>
__device__ __forceinline__ void StoreParam(void* out, size_t i, float p) {
  if constexpr (P == DType::kF32) {
    static_cast<float*>(out)[i] = p;
  } else if constexpr (P == DType::kBF16) {
    static_cast<uint16_t*>(out)[i] = FloatToBf16(p);
  } else {
    static_cast<uint16_t*>(out)[i] = FloatToF16(p);
  }
}

// One element's step, in the same operation order as
// daemon/cpu/adam_scalar.cc's Loop; every product and sum is rounded on its
// own (no FMA), as the CPU build's -ffp-contract=off guarantees there. m and
// v come in as the stored moments (widened) and go out unrounded.
template <bool kL2>
__device__ __forceinline__ void AdamMath(const cpu::AdamScalars& s, float g, float& p, float& m,
                                         float& v) {
  g = __fmul_rn(__fmul_rn(g, s.inv_grad_scale), s.clip_coef);
  if constexpr (kL2) g = __fadd_rn(g, __fmul_rn(s.l2_weight_decay, p));
  p = __fmul_rn(p, s.decay_factor);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  // (value * m) / denom, in the order torch's addcdiv_ and every CPU
  // variant evaluate it (value * (m / denom) differs by an ulp in ~10% of
  // elements, which gpu_adam_test caught on nvidia-h200).
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

// Element i of a run, loads and stores one at a time.
template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
__device__ __forceinline__ void AdamElement(const cpu::AdamScalars& s, const void* grad,
                                            float* master, const Moments& mo, void* out, size_t i) {
  float p = master[i];
  float m, v;
  if constexpr (kCompact) {
    m = Bf16ToFloat(mo.m16[i]);
    v = Bf16ToFloat(mo.v16[i]);
  } else {
    m = mo.m[i];
    v = mo.v[i];
  }
  AdamMath<kL2>(s, ScaledGrad<G>(s, LoadGrad<G>(grad, i)), p, m, v);
  master[i] = p;
  if constexpr (kCompact) {
    // The step used the unrounded m and v; only the stored copies narrow.
    mo.m16[i] = FloatToBf16(m);
    mo.v16[i] = StochasticRoundBF16(v, RoundingBits(s.rounding_seed, mo.element_offset + i));
  } else {
    mo.m[i] = m;
    mo.v[i] = v;
  }
  if constexpr (kWriteOut) StoreParam<P>(out, i, p);
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
__global__ void __launch_bounds__(kThreads)
    AdamKernel(cpu::AdamScalars s, const void* __restrict__ grad, float* __restrict__ master,
               Moments mo, void* __restrict__ out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    AdamElement<G, P, kWriteOut, kL2, kCompact>(s, grad, master, mo, out, i);
  }
}

// Four consecutive elements in one aligned access (16 bytes of fp32, 8 of
// a 16-bit type): what lets the update stream at HBM speed.
__device__ __forceinline__ void Load4(const float* a, size_t j, float x[4]) {
  const float4 v = reinterpret_cast<const float4*>(a)[j];
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void Store4(float* a, size_t j, const float x[4]) {
  reinterpret_cast<float4*>(a)[j] = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void Load4(const uint16_t* a, size_t j, uint16_t x[4]) {
  const uint2 v = reinterpret_cast<const uint2*>(a)[j];
  x[0] = v.x & 0xffffu, x[1] = v.x >> 16, x[2] = v.y & 0xffffu, x[3] = v.y >> 16;
}
__device__ __forceinline__ void Store4(uint16_t* a, size_t j, const uint16_t x[4]) {
  reinterpret_cast<uint2*>(a)[j] = make_uint2(x[0] | (static_cast<uint32_t>(x[1]) << 16),
                                              x[2] | (static_cast<uint32_t>(x[3]) << 16));
}

template <DType G>
__device__ __forceinline__ void LoadGrad4(const void* grad, size_t j, float g[4]) {
  if constexpr (G == DType::kF32) {
    Load4(static_cast<const float*>(grad), j, g);
  } else {
    uint16_t h[4];
    Load4(static_cast<const uint16_t*>(grad), j, h);
    for (int k = 0; k < 4; ++k) g[k] = G == DType::kBF16 ? Bf16ToFloat(h[k]) : F16ToFloat(h[k]);
  }
}

template <DType P>
__device__ __forceinline__ void StoreParam4(void* out, size_t j, const float p[4]) {
  if constexpr (P == DType::kF32) {
    Store4(static_cast<float*>(out), j, p);
  } else {
    uint16_t h[4];
    for (int k = 0; k < 4; ++k) h[k] = P == DType::kBF16 ? FloatToBf16(p[k]) : FloatToF16(p[k]);
    Store4(static_cast<uint16_t*>(out), j, h);
  }
}

// AdamKernel four elements a thread at a time (every array aligned to four
// elements: Aligned4), the n % 4 last ones one at a time; the same
// arithmetic per element, so the same bits.
template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
__global__ void __launch_bounds__(kThreads)
    AdamKernel4(cpu::AdamScalars s, const void* __restrict__ grad, float* __restrict__ master,
                Moments mo, void* __restrict__ out, size_t n) {
  const size_t groups = n / 4;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < groups;
       j += stride) {
    float g[4], p[4], m[4], v[4];
    LoadGrad4<G>(grad, j, g);
    Load4(master, j, p);
    if constexpr (kCompact) {
      uint16_t m16[4], v16[4];
      Load4(mo.m16, j, m16);
      Load4(mo.v16, j, v16);
      for (int k = 0; k < 4; ++k) m[k] = Bf16ToFloat(m16[k]), v[k] = Bf16ToFloat(v16[k]);
    } else {
      Load4(mo.m, j, m);
      Load4(mo.v, j, v);
    }
    for (int k = 0; k < 4; ++k) AdamMath<kL2>(s, ScaledGrad<G>(s, g[k]), p[k], m[k], v[k]);
    Store4(master, j, p);
    if constexpr (kCompact) {
      uint16_t m16[4], v16[4];
      for (int k = 0; k < 4; ++k) {
        m16[k] = FloatToBf16(m[k]);
        v16[k] =
            StochasticRoundBF16(v[k], RoundingBits(s.rounding_seed, mo.element_offset + 4 * j + k));
      }
      Store4(mo.m16, j, m16);
      Store4(mo.v16, j, v16);
    } else {
      Store4(mo.m, j, m);
      Store4(mo.v, j, v);
    }
    if constexpr (kWriteOut) StoreParam4<P>(out, j, p);
  }
  if (blockIdx.x == 0 && threadIdx.x < n % 4) {
    AdamElement<G, P, kWriteOut, kL2, kCompact>(s, grad, master, mo, out, 4 * groups + threadIdx.x);
  }
}

// Whether p may be read four elements of `bytes` at a time.
bool Aligned4(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % (4 * bytes) == 0;
}

unsigned Blocks(size_t n, unsigned max_blocks) {
  // Enough blocks to fill every SM several times over, or max_blocks; the
  // grid-stride loop covers the rest.
  const size_t cap = max_blocks != 0 ? max_blocks : 132 * 16;
  const size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < cap ? want : cap);
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
void LaunchKernel(const cpu::AdamScalars& s, const DeviceAdamSpan& sp, const Moments& mo,
                  cudaStream_t stream) {
  const size_t moment = kCompact ? sizeof(uint16_t) : sizeof(float);
  const bool vec = Aligned4(sp.grad, DTypeSize(G)) && Aligned4(sp.master, sizeof(float)) &&
                   Aligned4(kCompact ? static_cast<void*>(mo.m16) : mo.m, moment) &&
                   Aligned4(kCompact ? static_cast<void*>(mo.v16) : mo.v, moment) &&
                   (!kWriteOut || Aligned4(sp.param_out, DTypeSize(P)));
  if (vec) {
    AdamKernel4<G, P, kWriteOut, kL2, kCompact>
        <<<Blocks(sp.n / 4 + 1, sp.max_blocks), kThreads, 0, stream>>>(s, sp.grad, sp.master, mo,
                                                                       sp.param_out, sp.n);
  } else {
    AdamKernel<G, P, kWriteOut, kL2, kCompact>
        <<<Blocks(sp.n, sp.max_blocks), kThreads, 0, stream>>>(s, sp.grad, sp.master, mo,
                                                               sp.param_out, sp.n);
  }
}

template <DType G, DType P, bool kWriteOut, bool kL2>
void LaunchCompact(const cpu::AdamScalars& s, const DeviceAdamSpan& sp, cudaStream_t stream) {
  const Moments mo{sp.exp_avg, sp.exp_avg_sq, sp.exp_avg_bf16, sp.exp_avg_sq_bf16,
                   sp.element_offset};
  if (sp.exp_avg_bf16 != nullptr) {
    LaunchKernel<G, P, kWriteOut, kL2, true>(s, sp, mo, stream);
  } else {
    LaunchKernel<G, P, kWriteOut, kL2, false>(s, sp, mo, stream);
  }
}

template <DType G, DType P, bool kWriteOut>
void LaunchL2(const cpu::AdamScalars& s, const DeviceAdamSpan& sp, cudaStream_t stream) {
  if (s.l2_weight_decay != 0.0f) {
    LaunchCompact<G, P, kWriteOut, true>(s, sp, stream);
  } else {
    LaunchCompact<G, P, kWriteOut, false>(s, sp, stream);
  }
}

template <DType G>
void LaunchParam(const cpu::AdamScalars& s, const DeviceAdamSpan& sp, cudaStream_t stream) {
  if (sp.param_out == nullptr) return LaunchL2<G, DType::kF32, false>(s, sp, stream);
  switch (sp.param_dtype) {
    case DType::kF32: return LaunchL2<G, DType::kF32, true>(s, sp, stream);
    case DType::kBF16: return LaunchL2<G, DType::kBF16, true>(s, sp, stream);
    case DType::kF16: return LaunchL2<G, DType::kF16, true>(s, sp, stream);
  }
}

template <DType G>
__global__ void CastKernel(const void* __restrict__ in, size_t n, float* __restrict__ out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = LoadGrad<G>(in, i);
  }
}

}  // namespace

absl::Status LaunchAdam(const cpu::AdamScalars& s, const DeviceAdamSpan& span,
                        cudaStream_t stream) {
  if (span.n == 0) return absl::OkStatus();
  switch (span.grad_dtype) {
    case DType::kF32: LaunchParam<DType::kF32>(s, span, stream); break;
    case DType::kBF16: LaunchParam<DType::kBF16>(s, span, stream); break;
    case DType::kF16: LaunchParam<DType::kF16>(s, span, stream); break;
  }
  return DOS_CUDA_STATUS(cudaGetLastError());
}

absl::Status LaunchCastToFloat(const void* in, DType dtype, size_t n, float* out,
                               cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF32: return DOS_CUDA_STATUS(cudaMemcpyAsync(out, in, n * 4, cudaMemcpyDeviceToDevice, stream));
    case DType::kBF16:
      CastKernel<DType::kBF16><<<Blocks(n, 0), kThreads, 0, stream>>>(in, n, out);
      break;
    case DType::kF16:
      CastKernel<DType::kF16><<<Blocks(n, 0), kThreads, 0, stream>>>(in, n, out);
      break;
  }
  return DOS_CUDA_STATUS(cudaGetLastError());
}

}  // namespace dos::gpu
