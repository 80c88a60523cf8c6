// The yardsticks with AVX2 (compiled with -mavx2 only; called after
// __builtin_cpu_supports("avx2")).
#include <immintrin.h>

#include <cstdint>

#include "bench/cpu_adam/stream_pass.h"

namespace dos::bench::internal {
namespace {

inline __m256 LoadBf16x8(const uint16_t* p) {
  const __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(g), 16));
}

}  // namespace

void AdamPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const uint16_t* grad = static_cast<const uint16_t*>(s.grad);
  uint16_t* out = static_cast<uint16_t*>(s.param_out);
  size_t i = 0;
  for (; i + 8 <= s.n; i += 8) {
    const __m256 x = LoadBf16x8(grad + i);
    const __m256 p = _mm256_add_ps(_mm256_loadu_ps(s.master + i), x);
    _mm256_storeu_ps(s.master + i, p);
    _mm256_storeu_ps(s.exp_avg + i, _mm256_add_ps(_mm256_loadu_ps(s.exp_avg + i), x));
    _mm256_storeu_ps(s.exp_avg_sq + i, _mm256_add_ps(_mm256_loadu_ps(s.exp_avg_sq + i), x));
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(p), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < s.n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(grad[i]) << 16;
    float x;
    __builtin_memcpy(&x, &bits, 4);
    s.master[i] += x;
    s.exp_avg[i] += x;
    s.exp_avg_sq[i] += x;
    uint32_t pb;
    __builtin_memcpy(&pb, &s.master[i], 4);
    out[i] = static_cast<uint16_t>(pb >> 16);
  }
}

void ReadPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const uint16_t* grad = static_cast<const uint16_t*>(s.grad);
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= s.n; i += 8) {
    acc = _mm256_add_ps(acc, LoadBf16x8(grad + i));
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(s.master + i));
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(s.exp_avg + i));
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(s.exp_avg_sq + i));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  if (lanes[0] == 1.2345f) static_cast<uint16_t*>(s.param_out)[0] = 1;  // keeps the loads
}

void TriadPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const __m256 k = _mm256_set1_ps(0.5f);
  size_t i = 0;
  for (; i + 8 <= s.n; i += 8) {
    _mm256_storeu_ps(s.master + i,
                     _mm256_add_ps(_mm256_loadu_ps(s.exp_avg + i),
                                   _mm256_mul_ps(k, _mm256_loadu_ps(s.exp_avg_sq + i))));
  }
  for (; i < s.n; ++i) s.master[i] = s.exp_avg[i] + 0.5f * s.exp_avg_sq[i];
}

}  // namespace dos::bench::internal
