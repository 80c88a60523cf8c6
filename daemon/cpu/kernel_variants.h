// Internal: the per-ISA kernel entry points behind AdamKernel() and
// AllFiniteKernel(), and a list of every variant this CPU can run (tests and
// the benchmark iterate over it).
//
// Each vector variant lives in its own translation unit compiled with that
// ISA's flags (see CMakeLists.txt); nothing here may be called unless the
// matching IsaSupported()/CpuHasAvx512Bf16() check passed. Pure functions;
// thread-safe.
#pragma once

#include <string_view>
#include <vector>

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu::internal {

void AdamScalarKernel(const AdamScalars& s, const AdamSpan& span);
bool AllFiniteScalar(const void* grad, DType dtype, size_t n);

void AdamAvx2Kernel(const AdamScalars& s, const AdamSpan& span);
bool AllFiniteAvx2(const void* grad, DType dtype, size_t n);

// AVX-512 (F, BW, VL, DQ) with bf16 rounding done in integer arithmetic.
void AdamAvx512Kernel(const AdamScalars& s, const AdamSpan& span);
// The same, rounding to bf16 with AVX512-BF16's vcvtneps2bf16.
void AdamAvx512Bf16Kernel(const AdamScalars& s, const AdamSpan& span);
// The same two with non-temporal stores (Stores::kStreamOut / kStreamAll).
void AdamAvx512StreamOutKernel(const AdamScalars& s, const AdamSpan& span);
void AdamAvx512StreamAllKernel(const AdamScalars& s, const AdamSpan& span);
void AdamAvx512Bf16StreamOutKernel(const AdamScalars& s, const AdamSpan& span);
void AdamAvx512Bf16StreamAllKernel(const AdamScalars& s, const AdamSpan& span);
bool AllFiniteAvx512(const void* grad, DType dtype, size_t n);

bool CpuHasAvx512Bf16();

// The vector kernels' compact-state rounding of v alone, for
// tests/unit/cpu/stochastic_round_test: out[i] = StochasticRoundBF16(x[i],
// RoundingBits(seed, index0 + i)) for i < 8 (AVX2) or i < 16 (AVX-512).
void StochasticRoundAvx2(uint32_t seed, uint64_t index0, const float* x, uint16_t* out);
void StochasticRoundAvx512(uint32_t seed, uint64_t index0, const float* x, uint16_t* out);

struct KernelVariant {
  std::string_view name;  // "scalar", "avx2", "avx512", "avx512bf16", "avx512_ntout", ...
  Isa isa;
  AdamKernelFn adam;
  AllFiniteFn all_finite;
};
// Every variant compiled in, supported by this CPU or not.
std::vector<KernelVariant> AllKernelVariants();
// The subset this CPU can run.
std::vector<KernelVariant> SupportedKernelVariants();

}  // namespace dos::cpu::internal
