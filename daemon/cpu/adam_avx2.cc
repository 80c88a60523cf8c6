// AVX2 + F16C variant; compiled with -mavx2 -mf16c only (no -mfma: the
// kernel's numerics exclude fused multiply-add, see adam_scalar.cc). The
// operation order is the scalar kernel's, so results are bit-identical to
// it; the n % 8 tail runs the scalar kernel itself.
#include <immintrin.h>

#include <cstdint>

#include "daemon/cpu/kernel_dispatch.h"
#include "daemon/cpu/kernel_variants.h"

namespace dos::cpu::internal {
namespace {

constexpr size_t kLanes = 8;

// 8 int32 lanes holding values below 2^16 -> 8 uint16.
inline __m128i Narrow(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <DType G>
inline __m256 LoadGrad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// dtype.h's FloatToBF16 on 8 lanes (no bf16 instructions in AVX2).
inline __m128i RoundToBF16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return Narrow(r);
}

// vcvtps2ph matches dtype.h except for NaN payloads; see adam_avx512_impl.h.
inline __m128i RoundToF16(__m256 p) {
  __m128i h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0)) {
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(p), 16),
                                          _mm256_set1_epi32(0x8000));
    const __m128i q = Narrow(_mm256_or_si256(sign, _mm256_set1_epi32(0x7e00)));
    const __m256i nan32 = _mm256_castps_si256(nan);
    const __m128i nan16 =
        _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    h = _mm_blendv_epi8(h, q, nan16);
  }
  return h;
}

template <DType P>
inline void StoreParam(void* out, size_t i, __m256 p) {
  if constexpr (P == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, p);
  } else {
    const __m128i h = P == DType::kBF16 ? RoundToBF16(p) : RoundToF16(p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

// Compact state (adam_kernel.h): bf16 moments widened exactly, m stored with
// RoundToBF16 (dtype.h's rounding), v with the stochastic rounding.
inline __m256 WidenBF16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// stochastic_round.h's RoundingBits() of elements index0 .. index0 + 7.
inline __m256i RoundingBits8(uint32_t seed, uint64_t index0) {
  __m256i h = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(index0))),
                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kRoundingIndexMul)));
  h = _mm256_add_epi32(h, _mm256_set1_epi32(static_cast<int>(seed)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kRoundingMix1)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kRoundingMix2)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  return _mm256_srli_epi32(h, 16);
}

inline __m128i StochasticRoundBF16x8(__m256 x, __m256i bits16) {
  __m128i h = Narrow(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), bits16), 16));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  if (__builtin_expect(!_mm256_testz_ps(nan, nan), 0)) {
    const __m256i n32 = _mm256_castps_si256(nan);
    const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n32), _mm256_extracti128_si256(n32, 1));
    h = _mm_blendv_epi8(h, RoundToBF16(x), n16);
  }
  return h;
}

template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
void Loop(const AdamScalars& sc, const AdamSpan& span) {
  const __m256 beta1 = _mm256_set1_ps(sc.beta1), beta2 = _mm256_set1_ps(sc.beta2);
  const __m256 omb1 = _mm256_set1_ps(sc.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(sc.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(sc.eps), l2 = _mm256_set1_ps(sc.l2_weight_decay);
  const __m256 decay = _mm256_set1_ps(sc.decay_factor);
  const __m256 nss = _mm256_set1_ps(sc.neg_step_size);
  const __m256 bc2 = _mm256_set1_ps(sc.bias_correction2_sqrt);
  const __m256 inv_scale = _mm256_set1_ps(sc.inv_grad_scale);
  const __m256 clip = _mm256_set1_ps(sc.clip_coef);
  const __m256 grad_coef = _mm256_set1_ps(sc.grad_coef);
  const bool scales_grad = sc.grad_coef != 1.0f;
  const size_t n_vec = span.n - span.n % kLanes;
  for (size_t i = 0; i < n_vec; i += kLanes) {
    __m256 g = LoadGrad<G>(span.grad, i);
    if (scales_grad) {
      g = _mm256_mul_ps(g, grad_coef);
      if constexpr (G == DType::kBF16) {
        g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(RoundToBF16(g)), 16));
      }
    }
    __m256 p = _mm256_loadu_ps(span.master + i);
    __m256 m, v;
    if constexpr (kCompact) {
      m = WidenBF16(span.exp_avg_bf16 + i);
      v = WidenBF16(span.exp_avg_sq_bf16 + i);
    } else {
      m = _mm256_loadu_ps(span.exp_avg + i);
      v = _mm256_loadu_ps(span.exp_avg_sq + i);
    }
    g = _mm256_mul_ps(_mm256_mul_ps(g, inv_scale), clip);
    if constexpr (kL2) g = _mm256_add_ps(g, _mm256_mul_ps(l2, p));
    p = _mm256_mul_ps(p, decay);
    m = _mm256_add_ps(_mm256_mul_ps(beta1, m), _mm256_mul_ps(omb1, g));
    v = _mm256_add_ps(_mm256_mul_ps(beta2, v), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
    _mm256_storeu_ps(span.master + i, p);
    if constexpr (kCompact) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(span.exp_avg_bf16 + i), RoundToBF16(m));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(span.exp_avg_sq_bf16 + i),
                       StochasticRoundBF16x8(v, RoundingBits8(sc.rounding_seed, span.element_offset + i)));
    } else {
      _mm256_storeu_ps(span.exp_avg + i, m);
      _mm256_storeu_ps(span.exp_avg_sq + i, v);
    }
    if constexpr (kWriteOut) StoreParam<P>(span.param_out, i, p);
  }
  if (n_vec < span.n) {
    AdamSpan tail = span;
    const size_t gsize = DTypeSize(span.grad_dtype);
    tail.grad = static_cast<const char*>(span.grad) + n_vec * gsize;
    tail.master += n_vec;
    if constexpr (kCompact) {
      tail.exp_avg_bf16 += n_vec;
      tail.exp_avg_sq_bf16 += n_vec;
      tail.element_offset += n_vec;
    } else {
      tail.exp_avg += n_vec;
      tail.exp_avg_sq += n_vec;
    }
    if (span.param_out != nullptr) {
      tail.param_out = static_cast<char*>(span.param_out) + n_vec * DTypeSize(span.param_dtype);
    }
    tail.n = span.n - n_vec;
    AdamScalarKernel(sc, tail);
  }
}

template <bool kWide>
bool AllFiniteImpl(const void* grad, DType dtype, size_t n, __m256i exp) {
  constexpr size_t kPerVec = kWide ? 8 : 16;
  constexpr size_t kBlock = 4096;
  const char* base = static_cast<const char*>(grad);
  constexpr size_t kElemBytes = kWide ? 4 : 2;
  const size_t n_vec = n - n % kPerVec;
  for (size_t i = 0; i < n_vec;) {
    const size_t end = i + kBlock < n_vec ? i + kBlock : n_vec;
    __m256i bad = _mm256_setzero_si256();
    for (; i < end; i += kPerVec) {
      const __m256i x = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i * kElemBytes)), exp);
      bad = _mm256_or_si256(bad, kWide ? _mm256_cmpeq_epi32(x, exp) : _mm256_cmpeq_epi16(x, exp));
    }
    if (!_mm256_testz_si256(bad, bad)) return false;
  }
  return AllFiniteScalar(base + n_vec * kElemBytes, dtype, n - n_vec);
}

struct Avx2Loop {
  template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
  static void Run(const AdamScalars& s, const AdamSpan& span) {
    Loop<G, P, kWriteOut, kL2, kCompact>(s, span);
  }
};

}  // namespace

void AdamAvx2Kernel(const AdamScalars& s, const AdamSpan& span) {
  AdamDispatch<Avx2Loop>::Run(s, span);
}

void StochasticRoundAvx2(uint32_t seed, uint64_t index0, const float* x, uint16_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   StochasticRoundBF16x8(_mm256_loadu_ps(x), RoundingBits8(seed, index0)));
}

bool AllFiniteAvx2(const void* grad, DType dtype, size_t n) {
  switch (dtype) {
    case DType::kF32: return AllFiniteImpl<true>(grad, dtype, n, _mm256_set1_epi32(0x7f800000));
    case DType::kBF16: return AllFiniteImpl<false>(grad, dtype, n, _mm256_set1_epi16(0x7f80));
    case DType::kF16: return AllFiniteImpl<false>(grad, dtype, n, _mm256_set1_epi16(0x7c00));
  }
  return false;
}

}  // namespace dos::cpu::internal
