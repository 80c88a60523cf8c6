// AVX-512 variant using AVX512-BF16's vcvtneps2bf16 for bf16 weights;
// compiled with -mavx512bf16 in addition to adam_avx512.cc's flags.
#include "daemon/cpu/adam_avx512_impl.h"

namespace dos::cpu::internal {

void AdamAvx512Bf16Kernel(const AdamScalars& s, const AdamSpan& span) {
  AdamAvx512<true>(s, span);
}
void AdamAvx512Bf16StreamOutKernel(const AdamScalars& s, const AdamSpan& span) {
  AdamAvx512<true, 1>(s, span);
}
void AdamAvx512Bf16StreamAllKernel(const AdamScalars& s, const AdamSpan& span) {
  AdamAvx512<true, 2>(s, span);
}

}  // namespace dos::cpu::internal
