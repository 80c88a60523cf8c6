// The stream pass's inner loop with AVX2 (compiled with -mavx2 only; called
// after __builtin_cpu_supports("avx2")). 32-byte accesses are enough to
// saturate memory at any thread count that can: the pass is meant to be
// limited by DRAM, like the kernel.
#include <immintrin.h>

#include "bench/cpu_adam/stream_pass.h"

namespace dos::bench::internal {

void StreamTileAvx2(const StreamArrays& a, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.grad + i));
    const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(g), 16));
    const __m256 p = _mm256_add_ps(_mm256_loadu_ps(a.p + i), x);
    _mm256_storeu_ps(a.p + i, p);
    _mm256_storeu_ps(a.m + i, _mm256_add_ps(_mm256_loadu_ps(a.m + i), x));
    _mm256_storeu_ps(a.v + i, _mm256_add_ps(_mm256_loadu_ps(a.v + i), x));
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(p), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.out + i), h);
  }
  for (; i < end; ++i) {
    const uint32_t bits = static_cast<uint32_t>(a.grad[i]) << 16;
    float x;
    __builtin_memcpy(&x, &bits, 4);
    a.p[i] += x;
    a.m[i] += x;
    a.v[i] += x;
    uint32_t pb;
    __builtin_memcpy(&pb, &a.p[i], 4);
    a.out[i] = static_cast<uint16_t>(pb >> 16);
  }
}

}  // namespace dos::bench::internal
