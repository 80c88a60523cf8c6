// The stream pass's inner loop with AVX-512 (compiled with -mavx512f
// -mavx512bw only; called after __builtin_cpu_supports says so), so that the
// yardstick uses the same access width as the kernel it judges.
#include <immintrin.h>

#include "bench/cpu_adam/stream_pass.h"

namespace dos::bench::internal {

void StreamTileAvx512(const StreamArrays& a, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.grad + i));
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(g), 16));
    const __m512 p = _mm512_add_ps(_mm512_loadu_ps(a.p + i), x);
    _mm512_storeu_ps(a.p + i, p);
    _mm512_storeu_ps(a.m + i, _mm512_add_ps(_mm512_loadu_ps(a.m + i), x));
    _mm512_storeu_ps(a.v + i, _mm512_add_ps(_mm512_loadu_ps(a.v + i), x));
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out + i), h);
  }
  if (i < end) StreamTileAvx2(a, i, end);
}

}  // namespace dos::bench::internal
