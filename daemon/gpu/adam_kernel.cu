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

// Same operation order as daemon/cpu/adam_scalar.cc's Loop; every product
// and sum is rounded on its own (no FMA), as the CPU build's
// -ffp-contract=off guarantees there.
template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
__global__ void __launch_bounds__(kThreads)
    AdamKernel(cpu::AdamScalars s, const void* __restrict__ grad, float* __restrict__ master,
               Moments mo, void* __restrict__ out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float g = LoadGrad<G>(grad, i);
    float p = master[i];
    float m_old, v_old;
    if constexpr (kCompact) {
      m_old = Bf16ToFloat(mo.m16[i]);
      v_old = Bf16ToFloat(mo.v16[i]);
    } else {
      m_old = mo.m[i];
      v_old = mo.v[i];
    }
    g = __fmul_rn(__fmul_rn(g, s.inv_grad_scale), s.clip_coef);
    if constexpr (kL2) g = __fadd_rn(g, __fmul_rn(s.l2_weight_decay, p));
    p = __fmul_rn(p, s.decay_factor);
    const float m = __fadd_rn(__fmul_rn(s.beta1, m_old), __fmul_rn(s.one_minus_beta1, g));
    const float v =
        __fadd_rn(__fmul_rn(s.beta2, v_old), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
    // (value * m) / denom, in the order torch's addcdiv_ and every CPU
    // variant evaluate it (value * (m / denom) differs by an ulp in ~10% of
    // elements, which gpu_adam_test caught on nvidia-h200).
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
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
}

unsigned Blocks(size_t n) {
  // Enough blocks to fill every SM several times over; the grid-stride loop
  // covers the rest.
  size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 132 * 16 ? want : 132 * 16);
}

template <DType G, DType P, bool kWriteOut, bool kL2>
void LaunchCompact(const cpu::AdamScalars& s, const DeviceAdamSpan& sp, cudaStream_t stream) {
  const Moments mo{sp.exp_avg, sp.exp_avg_sq, sp.exp_avg_bf16, sp.exp_avg_sq_bf16,
                   sp.element_offset};
  if (sp.exp_avg_bf16 != nullptr) {
    AdamKernel<G, P, kWriteOut, kL2, true><<<Blocks(sp.n), kThreads, 0, stream>>>(
        s, sp.grad, sp.master, mo, sp.param_out, sp.n);
  } else {
    AdamKernel<G, P, kWriteOut, kL2, false><<<Blocks(sp.n), kThreads, 0, stream>>>(
        s, sp.grad, sp.master, mo, sp.param_out, sp.n);
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
__global__ void NonFiniteKernel(const void* __restrict__ grad, size_t n, int* flag) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    if constexpr (G == DType::kF32) {
      bad |= (static_cast<const uint32_t*>(grad)[i] & 0x7f800000u) == 0x7f800000u;
    } else {
      constexpr uint16_t kExp = G == DType::kBF16 ? 0x7f80u : 0x7c00u;
      bad |= (static_cast<const uint16_t*>(grad)[i] & kExp) == kExp;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
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

absl::Status LaunchNonFiniteScan(const void* grad, DType dtype, size_t n, int* flag,
                                 cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF32: NonFiniteKernel<DType::kF32><<<Blocks(n), kThreads, 0, stream>>>(grad, n, flag); break;
    case DType::kBF16: NonFiniteKernel<DType::kBF16><<<Blocks(n), kThreads, 0, stream>>>(grad, n, flag); break;
    case DType::kF16: NonFiniteKernel<DType::kF16><<<Blocks(n), kThreads, 0, stream>>>(grad, n, flag); break;
  }
  return DOS_CUDA_STATUS(cudaGetLastError());
}

absl::Status LaunchCastToFloat(const void* in, DType dtype, size_t n, float* out,
                               cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF32: return DOS_CUDA_STATUS(cudaMemcpyAsync(out, in, n * 4, cudaMemcpyDeviceToDevice, stream));
    case DType::kBF16: CastKernel<DType::kBF16><<<Blocks(n), kThreads, 0, stream>>>(in, n, out); break;
    case DType::kF16: CastKernel<DType::kF16><<<Blocks(n), kThreads, 0, stream>>>(in, n, out); break;
  }
  return DOS_CUDA_STATUS(cudaGetLastError());
}

}  // namespace dos::gpu
