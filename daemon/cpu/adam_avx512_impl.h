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

#include "daemon/cpu/kernel_dispatch.h"
#include "daemon/cpu/kernel_variants.h"

namespace dos::cpu::internal {
namespace {

constexpr size_t kLanes = 16;

template <bool kMasked>
inline __m512 LoadF32(const float* p, __mmask16 k) {
  if constexpr (kMasked) return _mm512_maskz_loadu_ps(k, p);
  return _mm512_loadu_ps(p);
}

// kStream: non-temporal store (the caller guarantees 64-byte alignment).
template <bool kMasked, bool kStream = false>
inline void StoreF32(float* p, __mmask16 k, __m512 x) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, k, x);
  } else if constexpr (kStream) {
    _mm512_stream_ps(p, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

template <bool kMasked>
inline __m256i LoadU16(const uint16_t* p, __mmask16 k) {
  if constexpr (kMasked) return _mm256_maskz_loadu_epi16(k, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// kStream: non-temporal store (the caller guarantees 32-byte alignment).
template <bool kMasked, bool kStream = false>
inline void StoreU16(uint16_t* p, __mmask16 k, __m256i x) {
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, k, x);
  } else if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
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

template <DType P, bool kNativeBf16, bool kMasked, bool kStream>
inline void StoreParam(void* out, size_t i, __mmask16 k, __m512 p) {
  if constexpr (P == DType::kF32) {
    StoreF32<kMasked, kStream>(static_cast<float*>(out) + i, k, p);
  } else if constexpr (P == DType::kBF16) {
    StoreU16<kMasked, kStream>(static_cast<uint16_t*>(out) + i, k, RoundToBF16<kNativeBf16>(p));
  } else {
    StoreU16<kMasked, kStream>(static_cast<uint16_t*>(out) + i, k, RoundToF16(p));
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
        clip_coef(_mm512_set1_ps(s.clip_coef)),
        grad_coef(_mm512_set1_ps(s.grad_coef)),
        rounding_seed(s.rounding_seed),
        scales_grad(s.grad_coef != 1.0f) {}
  __m512 beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2_weight_decay, decay_factor,
      neg_step_size, bias_correction2_sqrt, inv_grad_scale, clip_coef, grad_coef;
  uint32_t rounding_seed;
  bool scales_grad;
};

// kStream selects non-temporal stores for the weight out and, with
// kStreamState, for p, m and v too (unmasked steps only; see Loop).
inline __m512 WidenBF16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// stochastic_round.h's RoundingBits() of elements index0 .. index0 + 15.
inline __m512i RoundingBits16(uint32_t seed, uint64_t index0) {
  __m512i h = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(index0))),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kRoundingIndexMul)));
  h = _mm512_add_epi32(h, _mm512_set1_epi32(static_cast<int>(seed)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kRoundingMix1)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kRoundingMix2)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  return _mm512_srli_epi32(h, 16);
}

// StochasticRoundBF16() on 16 lanes; NaN lanes take dtype.h's conversion.
inline __m256i StochasticRoundBF16x16(__m512 x, __m512i bits16) {
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), bits16), 16);
  __m256i h = _mm512_cvtepi32_epi16(r);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (__builtin_expect(nan != 0, 0)) h = _mm256_mask_blend_epi16(nan, h, RoundToBF16Int(x));
  return h;
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kNativeBf16, bool kMasked,
          bool kStream = false, bool kStreamState = false, bool kCompact = false>
inline void Step16(const VecScalars& s, const AdamSpan& span, size_t i, __mmask16 k) {
  __m512 g = LoadGrad<G, kMasked>(span.grad, i, k);
  if (s.scales_grad) {
    g = _mm512_mul_ps(g, s.grad_coef);
    if constexpr (G == DType::kBF16) g = WidenBF16(RoundToBF16<kNativeBf16>(g));
  }
  __m512 p = LoadF32<kMasked>(span.master + i, k);
  __m512 m, v;
  if constexpr (kCompact) {
    m = WidenBF16(LoadU16<kMasked>(span.exp_avg_bf16 + i, k));
    v = WidenBF16(LoadU16<kMasked>(span.exp_avg_sq_bf16 + i, k));
  } else {
    m = LoadF32<kMasked>(span.exp_avg + i, k);
    v = LoadF32<kMasked>(span.exp_avg_sq + i, k);
  }
  g = _mm512_mul_ps(_mm512_mul_ps(g, s.inv_grad_scale), s.clip_coef);
  if constexpr (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(s.l2_weight_decay, p));
  p = _mm512_mul_ps(p, s.decay_factor);
  m = _mm512_add_ps(_mm512_mul_ps(s.beta1, m), _mm512_mul_ps(s.one_minus_beta1, g));
  v = _mm512_add_ps(_mm512_mul_ps(s.beta2, v), _mm512_mul_ps(_mm512_mul_ps(s.one_minus_beta2, g), g));
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), s.bias_correction2_sqrt), s.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(s.neg_step_size, m), denom));
  StoreF32<kMasked, kStreamState>(span.master + i, k, p);
  if constexpr (kCompact) {
    StoreU16<kMasked, kStreamState>(span.exp_avg_bf16 + i, k, RoundToBF16<kNativeBf16>(m));
    StoreU16<kMasked, kStreamState>(
        span.exp_avg_sq_bf16 + i, k,
        StochasticRoundBF16x16(v, RoundingBits16(s.rounding_seed, span.element_offset + i)));
  } else {
    StoreF32<kMasked, kStreamState>(span.exp_avg + i, k, m);
    StoreF32<kMasked, kStreamState>(span.exp_avg_sq + i, k, v);
  }
  if constexpr (kWriteOut) {
    StoreParam<P, kNativeBf16, kMasked, kStream>(span.param_out, i, k, p);
  }
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kNativeBf16, bool kCompact,
          bool kStream, bool kStreamState>
void LoopBody(const VecScalars& s, const AdamSpan& span, size_t i) {
  const size_t n = span.n;
  for (; i + kLanes <= n; i += kLanes) {
    Step16<G, P, kWriteOut, kL2, kNativeBf16, false, kStream, kStreamState, kCompact>(s, span, i,
                                                                                      0xffff);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    Step16<G, P, kWriteOut, kL2, kNativeBf16, true, false, false, kCompact>(s, span, i, k);
  }
}

inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Streaming variant (kStreamMode 1: the weight out only; 2: p, m, v and the
// weight out): non-temporal stores skip the read-for-ownership of lines the
// kernel overwrites whole and keep the streams out of the caches. They need
// aligned addresses, so a masked head step brings the master array to a
// 64-byte boundary; if the other written arrays are not then aligned too,
// the run takes ordinary stores. Every lane computes exactly what the plain
// loop computes: only how the results reach memory differs. The closing
// sfence orders the weakly-ordered stores before whatever the caller uses to
// publish the result.
template <DType G, DType P, bool kWriteOut, bool kL2, bool kNativeBf16, int kStreamMode,
          bool kCompact>
void Loop(const AdamScalars& scalars, const AdamSpan& span) {
  const VecScalars s(scalars);
  if constexpr (kStreamMode == 0) {
    LoopBody<G, P, kWriteOut, kL2, kNativeBf16, kCompact, false, false>(s, span, 0);
  } else {
    const size_t head = ((64 - reinterpret_cast<uintptr_t>(span.master) % 64) % 64) / 4;
    if (head >= span.n) {
      LoopBody<G, P, kWriteOut, kL2, kNativeBf16, kCompact, false, false>(s, span, 0);
      return;
    }
    if (head > 0) {
      Step16<G, P, kWriteOut, kL2, kNativeBf16, true, false, false, kCompact>(
          s, span, 0, static_cast<__mmask16>((1u << head) - 1));
    }
    constexpr uintptr_t kOutAlign = P == DType::kF32 ? 64 : 32;
    const size_t out_size = P == DType::kF32 ? 4 : 2;
    const bool out_ok =
        !kWriteOut || Aligned(static_cast<const char*>(span.param_out) + head * out_size, kOutAlign);
    bool state_ok = true;
    if constexpr (kStreamMode == 2) {
      state_ok = kCompact ? Aligned(span.exp_avg_bf16 + head, 32) &&
                                Aligned(span.exp_avg_sq_bf16 + head, 32)
                          : Aligned(span.exp_avg + head, 64) && Aligned(span.exp_avg_sq + head, 64);
    }
    if (out_ok && state_ok) {
      LoopBody<G, P, kWriteOut, kL2, kNativeBf16, kCompact, kWriteOut, kStreamMode == 2>(s, span,
                                                                                         head);
      _mm_sfence();
    } else {
      LoopBody<G, P, kWriteOut, kL2, kNativeBf16, kCompact, false, false>(s, span, head);
    }
  }
}

template <bool kNativeBf16, int kStreamMode>
struct Avx512Loop {
  template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
  static void Run(const AdamScalars& s, const AdamSpan& span) {
    Loop<G, P, kWriteOut, kL2, kNativeBf16, kStreamMode, kCompact>(s, span);
  }
};

// kStreamMode: 0 ordinary stores; 1 non-temporal weight out; 2 non-temporal
// p, m, v and weight out.
template <bool kNativeBf16, int kStreamMode = 0>
void AdamAvx512(const AdamScalars& s, const AdamSpan& span) {
  AdamDispatch<Avx512Loop<kNativeBf16, kStreamMode>>::Run(s, span);
}

}  // namespace
}  // namespace dos::cpu::internal
