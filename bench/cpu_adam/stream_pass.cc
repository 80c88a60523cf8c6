#include "bench/cpu_adam/stream_pass.h"

#include <cstdint>
#include <cstring>

namespace dos::bench {
namespace {

float Bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

void AdamPassScalar(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const uint16_t* g = static_cast<const uint16_t*>(s.grad);
  uint16_t* out = static_cast<uint16_t*>(s.param_out);
  for (size_t i = 0; i < s.n; ++i) {
    const float x = Bf16(g[i]);
    s.master[i] += x;
    s.exp_avg[i] += x;
    s.exp_avg_sq[i] += x;
    uint32_t pb;
    std::memcpy(&pb, &s.master[i], 4);
    out[i] = static_cast<uint16_t>(pb >> 16);
  }
}

void ReadPassScalar(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  const uint16_t* g = static_cast<const uint16_t*>(s.grad);
  float acc = 0.0f;
  for (size_t i = 0; i < s.n; ++i) acc += Bf16(g[i]) + s.master[i] + s.exp_avg[i] + s.exp_avg_sq[i];
  if (acc == 1.2345f) static_cast<uint16_t*>(s.param_out)[0] = 1;  // keeps the loads
}

void TriadPassScalar(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  for (size_t i = 0; i < s.n; ++i) s.master[i] = s.exp_avg[i] + 0.5f * s.exp_avg_sq[i];
}

}  // namespace

std::vector<Yardstick> Yardsticks() {
  constexpr size_t kAdam = 2 + 12 + 12 + 2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    return {{"adam", internal::AdamPassAvx512, kAdam},
            {"adam_ntout", internal::AdamPassNtOutAvx512, kAdam},
            {"adam_ntall", internal::AdamPassNtAllAvx512, kAdam},
            {"read", internal::ReadPassAvx512, 14},
            {"triad", internal::TriadPassAvx512, 12}};
  }
  if (__builtin_cpu_supports("avx2")) {
    return {{"adam", internal::AdamPassAvx2, kAdam},
            {"read", internal::ReadPassAvx2, 14},
            {"triad", internal::TriadPassAvx2, 12}};
  }
  return {{"adam", AdamPassScalar, kAdam},
          {"read", ReadPassScalar, 14},
          {"triad", TriadPassScalar, 12}};
}

}  // namespace dos::bench
