// AVX-512 (F, BW, VL, DQ) variant; compiled with those flags only.
#include "daemon/cpu/adam_avx512_impl.h"

namespace dos::cpu::internal {
namespace {

// Non-finite means all exponent bits set. The per-lane tests of a block are
// ORed together; the check between blocks bounds the work after a hit.
template <uint32_t kExpMask32, uint16_t kExpMask16, bool kWide>
bool AllFiniteImpl(const void* grad, size_t n) {
  constexpr size_t kPerVec = kWide ? 16 : 32;
  constexpr size_t kBlock = 4096;
  const __m512i exp = kWide ? _mm512_set1_epi32(static_cast<int>(kExpMask32))
                            : _mm512_set1_epi16(static_cast<short>(kExpMask16));
  const char* base = static_cast<const char*>(grad);
  constexpr size_t kElemBytes = kWide ? 4 : 2;
  size_t i = 0;
  while (i < n) {
    const size_t end = i + kBlock < n ? i + kBlock : n;
    uint64_t bad = 0;
    for (; i + kPerVec <= end; i += kPerVec) {
      const __m512i x = _mm512_and_si512(_mm512_loadu_si512(base + i * kElemBytes), exp);
      bad |= kWide ? _mm512_cmpeq_epi32_mask(x, exp) : _mm512_cmpeq_epi16_mask(x, exp);
    }
    if (i < end) {
      const size_t rem = end - i;
      __m512i x;
      if constexpr (kWide) {
        x = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << rem) - 1), base + i * kElemBytes);
      } else {
        x = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << rem) - 1),
                                     base + i * kElemBytes);
      }
      x = _mm512_and_si512(x, exp);
      bad |= kWide ? _mm512_cmpeq_epi32_mask(x, exp) : _mm512_cmpeq_epi16_mask(x, exp);
      i = end;
    }
    if (bad != 0) return false;
  }
  return true;
}

}  // namespace

void AdamAvx512Kernel(const AdamScalars& s, const AdamSpan& span) { AdamAvx512<false>(s, span); }
void AdamAvx512StreamOutKernel(const AdamScalars& s, const AdamSpan& span) {
  AdamAvx512<false, 1>(s, span);
}
void AdamAvx512StreamAllKernel(const AdamScalars& s, const AdamSpan& span) {
  AdamAvx512<false, 2>(s, span);
}

void StochasticRoundAvx512(uint32_t seed, uint64_t index0, const float* x, uint16_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      StochasticRoundBF16x16(_mm512_loadu_ps(x), RoundingBits16(seed, index0)));
}

bool AllFiniteAvx512(const void* grad, DType dtype, size_t n) {
  switch (dtype) {
    case DType::kF32: return AllFiniteImpl<0x7f800000u, 0, true>(grad, n);
    case DType::kBF16: return AllFiniteImpl<0, 0x7f80u, false>(grad, n);
    case DType::kF16: return AllFiniteImpl<0, 0x7c00u, false>(grad, n);
  }
  return false;
}

}  // namespace dos::cpu::internal
