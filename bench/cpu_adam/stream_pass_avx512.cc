// The yardsticks with AVX-512 (compiled with -mavx512f -mavx512bw only;
// called after __builtin_cpu_supports says so), so that they use the same
// access width, and for the "nt" forms the same non-temporal stores and
// alignment rule, as the kernel they judge.
#include <immintrin.h>

#include <cstdint>

#include "bench/cpu_adam/stream_pass.h"

namespace dos::bench::internal {
namespace {

inline __m512 LoadBf16x16(const uint16_t* p) {
  const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(g), 16));
}

inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// kMode 0: ordinary stores; 1: non-temporal weight out; 2: everything
// written non-temporal (only once the arrays are aligned, like the kernel).
template <int kMode>
void AdamPass(const cpu::AdamSpan& s) {
  const uint16_t* grad = static_cast<const uint16_t*>(s.grad);
  uint16_t* out = static_cast<uint16_t*>(s.param_out);
  size_t i = 0;
  if constexpr (kMode != 0) {
    const size_t head = ((64 - reinterpret_cast<uintptr_t>(s.master) % 64) % 64) / 4;
    const bool ok =
        head < s.n && Aligned(out + head, 32) &&
        (kMode < 2 || (Aligned(s.exp_avg + head, 64) && Aligned(s.exp_avg_sq + head, 64)));
    if (!ok) return AdamPass<0>(s);
    cpu::AdamSpan h = s;
    h.n = head;
    AdamPass<0>(h);
    i = head;
  }
  for (; i + 16 <= s.n; i += 16) {
    const __m512 x = LoadBf16x16(grad + i);
    const __m512 p = _mm512_add_ps(_mm512_loadu_ps(s.master + i), x);
    const __m512 m = _mm512_add_ps(_mm512_loadu_ps(s.exp_avg + i), x);
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(s.exp_avg_sq + i), x);
    const __m256i o = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    if constexpr (kMode == 2) {
      _mm512_stream_ps(s.master + i, p);
      _mm512_stream_ps(s.exp_avg + i, m);
      _mm512_stream_ps(s.exp_avg_sq + i, v);
    } else {
      _mm512_storeu_ps(s.master + i, p);
      _mm512_storeu_ps(s.exp_avg + i, m);
      _mm512_storeu_ps(s.exp_avg_sq + i, v);
    }
    if constexpr (kMode != 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), o);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), o);
    }
  }
  if constexpr (kMode != 0) _mm_sfence();
  if (i < s.n) {
    cpu::AdamSpan t = s;
    t.grad = grad + i;
    t.master += i;
    t.exp_avg += i;
    t.exp_avg_sq += i;
    t.param_out = out + i;
    t.n = s.n - i;
    AdamPassAvx2({}, t);
  }
}

}  // namespace

void AdamPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s) { AdamPass<0>(s); }
void AdamPassNtOutAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s) { AdamPass<1>(s); }
void AdamPassNtAllAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s) { AdamPass<2>(s); }

void ReadPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const uint16_t* grad = static_cast<const uint16_t*>(s.grad);
  // Two accumulators: the adds' latency must not limit the load rate.
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= s.n; i += 16) {
    a = _mm512_add_ps(a, LoadBf16x16(grad + i));
    b = _mm512_add_ps(b, _mm512_loadu_ps(s.master + i));
    a = _mm512_add_ps(a, _mm512_loadu_ps(s.exp_avg + i));
    b = _mm512_add_ps(b, _mm512_loadu_ps(s.exp_avg_sq + i));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(a, b));
  if (lanes[0] == 1.2345f) {
    static_cast<uint16_t*>(s.param_out)[0] = 1;  // keeps the loads
  }
}

void TriadPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const __m512 k = _mm512_set1_ps(0.5f);
  size_t i = 0;
  for (; i + 16 <= s.n; i += 16) {
    _mm512_storeu_ps(s.master + i,
                     _mm512_add_ps(_mm512_loadu_ps(s.exp_avg + i),
                                   _mm512_mul_ps(k, _mm512_loadu_ps(s.exp_avg_sq + i))));
  }
  for (; i < s.n; ++i) s.master[i] = s.exp_avg[i] + 0.5f * s.exp_avg_sq[i];
}

}  // namespace dos::bench::internal
