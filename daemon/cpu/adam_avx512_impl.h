// Internal: the AVX-512 kernel body, included by adam_avx512.cc (bf16
// rounding in integer arithmetic) and adam_avx512_bf16.cc (vcvtneps2bf16),
// each compiled with its own -m flags. Everything here has internal linkage
// on purpose: the same helper compiled with and without -mavx512bf16 must
// not be merged by the linker into one copy that a CPU without AVX512-BF16
// could end up executing.
//
// The operation order is adam_scalar.cc's exactly, without fused
// multiply-add, so every lane rounds like the scalar kernel; the 16-bit
// conversions are made bit-identical to dtype.h's, NaN payloads included.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "daemon/cpu/kernel_variants.h"

namespace dos::cpu::internal {
namespace {

constexpr size_t kLanes = 16;

template <bool kMasked>
inline __m512 LoadF32(const float* p, __mmask16 k) {
  if constexpr (kMasked) return _mm512_maskz_loadu_ps(k, p);
  return _mm512_loadu_ps(p);
}

template <bool kMasked>
inline void StoreF32(float* p, __mmask16 k, __m512 x) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, k, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

template <bool kMasked>
inline __m256i LoadU16(const uint16_t* p, __mmask16 k) {
  if constexpr (kMasked) return _mm256_maskz_loadu_epi16(k, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <bool kMasked>
inline void StoreU16(uint16_t* p, __mmask16 k, __m256i x) {
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, k, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
}

template <DType G, bool kMasked>
inline __m512 LoadGrad(const void* grad, size_t i, __mmask16 k) {
  if constexpr (G == DType::kF32) {
    return LoadF32<kMasked>(static_cast<const float*>(grad) + i, k);
  } else {
    const __m256i h = LoadU16<kMasked>(static_cast<const uint16_t*>(grad) + i, k);
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);  // exact, subnormals included
    }
  }
}

// dtype.h's FloatToBF16 on 16 lanes: add 0x7fff plus the kept lsb, then
// truncate; NaN becomes its upper half with the quiet bit set.
inline __m256i RoundToBF16Int(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kNativeBf16>
inline __m256i RoundToBF16(__m512 p) {
  if constexpr (kNativeBf16) {
#ifdef __AVX512BF16__
    // vcvtneps2bf16 rounds to nearest even and quiets NaN exactly as dtype.h
    // does, but treats subnormal inputs as zero; those lanes (rare: only
    // weights below 1.2e-38) take the integer path.
    __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p));
    const __mmask16 sub = _mm512_fpclass_ps_mask(p, 0x20);
    if (__builtin_expect(sub != 0, 0)) h = _mm256_mask_blend_epi16(sub, h, RoundToBF16Int(p));
    return h;
#else
    static_assert(!kNativeBf16, "compile with -mavx512bf16");
#endif
  }
  return RoundToBF16Int(p);
}

// vcvtps2ph rounds exactly like dtype.h's FloatToF16 (nearest even, overflow
// to inf, subnormals exact) but keeps NaN payload bits; dtype.h (and PyTorch's
// scalar conversion) return the canonical quiet NaN, so NaN lanes are patched.
inline __m256i RoundToF16(__m512 p) {
  __m256i h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  if (__builtin_expect(nan != 0, 0)) {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(p), 16),
                                          _mm512_set1_epi32(0x8000));
    const __m256i q = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
    h = _mm256_mask_blend_epi16(nan, h, q);
  }
  return h;
}

template <DType P, bool kNativeBf16, bool kMasked>
inline void StoreParam(void* out, size_t i, __mmask16 k, __m512 p) {
  if constexpr (P == DType::kF32) {
    StoreF32<kMasked>(static_cast<float*>(out) + i, k, p);
  } else if constexpr (P == DType::kBF16) {
    StoreU16<kMasked>(static_cast<uint16_t*>(out) + i, k, RoundToBF16<kNativeBf16>(p));
  } else {
    StoreU16<kMasked>(static_cast<uint16_t*>(out) + i, k, RoundToF16(p));
  }
}

struct VecScalars {
  explicit VecScalars(const AdamScalars& s)
      : beta1(_mm512_set1_ps(s.beta1)),
        beta2(_mm512_set1_ps(s.beta2)),
        one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)),
        one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        eps(_mm512_set1_ps(s.eps)),
        l2_weight_decay(_mm512_set1_ps(s.l2_weight_decay)),
        decay_factor(_mm512_set1_ps(s.decay_factor)),
        neg_step_size(_mm512_set1_ps(s.neg_step_size)),
        bias_correction2_sqrt(_mm512_set1_ps(s.bias_correction2_sqrt)),
        inv_grad_scale(_mm512_set1_ps(s.inv_grad_scale)),
        clip_coef(_mm512_set1_ps(s.clip_coef)) {}
  __m512 beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2_weight_decay, decay_factor,
      neg_step_size, bias_correction2_sqrt, inv_grad_scale, clip_coef;
};

template <DType G, DType P, bool kWriteOut, bool kL2, bool kNativeBf16, bool kMasked>
inline void Step16(const VecScalars& s, const AdamSpan& span, size_t i, __mmask16 k) {
  __m512 g = LoadGrad<G, kMasked>(span.grad, i, k);
  __m512 p = LoadF32<kMasked>(span.master + i, k);
  __m512 m = LoadF32<kMasked>(span.exp_avg + i, k);
  __m512 v = LoadF32<kMasked>(span.exp_avg_sq + i, k);
  g = _mm512_mul_ps(_mm512_mul_ps(g, s.inv_grad_scale), s.clip_coef);
  if constexpr (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(s.l2_weight_decay, p));
  p = _mm512_mul_ps(p, s.decay_factor);
  m = _mm512_add_ps(_mm512_mul_ps(s.beta1, m), _mm512_mul_ps(s.one_minus_beta1, g));
  v = _mm512_add_ps(_mm512_mul_ps(s.beta2, v), _mm512_mul_ps(_mm512_mul_ps(s.one_minus_beta2, g), g));
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), s.bias_correction2_sqrt), s.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(s.neg_step_size, m), denom));
  StoreF32<kMasked>(span.master + i, k, p);
  StoreF32<kMasked>(span.exp_avg + i, k, m);
  StoreF32<kMasked>(span.exp_avg_sq + i, k, v);
  if constexpr (kWriteOut) StoreParam<P, kNativeBf16, kMasked>(span.param_out, i, k, p);
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kNativeBf16>
void Loop(const AdamScalars& scalars, const AdamSpan& span) {
  const VecScalars s(scalars);
  const size_t n = span.n;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Step16<G, P, kWriteOut, kL2, kNativeBf16, false>(s, span, i, 0xffff);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    Step16<G, P, kWriteOut, kL2, kNativeBf16, true>(s, span, i, k);
  }
}

template <DType G, DType P, bool kWriteOut, bool kNativeBf16>
void DispatchL2(const AdamScalars& s, const AdamSpan& span) {
  if (s.l2_weight_decay != 0.0f) {
    Loop<G, P, kWriteOut, true, kNativeBf16>(s, span);
  } else {
    Loop<G, P, kWriteOut, false, kNativeBf16>(s, span);
  }
}

template <DType G, bool kNativeBf16>
void DispatchParam(const AdamScalars& s, const AdamSpan& span) {
  if (span.param_out == nullptr) return DispatchL2<G, DType::kF32, false, kNativeBf16>(s, span);
  switch (span.param_dtype) {
    case DType::kF32: return DispatchL2<G, DType::kF32, true, kNativeBf16>(s, span);
    case DType::kBF16: return DispatchL2<G, DType::kBF16, true, kNativeBf16>(s, span);
    case DType::kF16: return DispatchL2<G, DType::kF16, true, kNativeBf16>(s, span);
  }
}

template <bool kNativeBf16>
void AdamAvx512(const AdamScalars& s, const AdamSpan& span) {
  switch (span.grad_dtype) {
    case DType::kF32: return DispatchParam<DType::kF32, kNativeBf16>(s, span);
    case DType::kBF16: return DispatchParam<DType::kBF16, kNativeBf16>(s, span);
    case DType::kF16: return DispatchParam<DType::kF16, kNativeBf16>(s, span);
  }
}

}  // namespace
}  // namespace dos::cpu::internal
