// Run-time ISA selection. The vector variants are compiled with their own
// per-file flags, so nothing here may execute their code before CPUID (via
// __builtin_cpu_supports) says the CPU has the instructions.
#include <cpuid.h>

#include <cstdlib>

#include "daemon/cpu/kernel_variants.h"

namespace dos::cpu {
namespace {

// F16C (CPUID.1:ECX bit 29) read directly: clang 14's __builtin_cpu_supports
// does not know "f16c".
bool CpuHasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool CpuHasAvx2() { return __builtin_cpu_supports("avx2") && CpuHasF16c(); }

bool CpuHasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "invalid";
}

bool ParseIsa(std::string_view text, Isa* out) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (text == IsaName(isa)) {
      *out = isa;
      return true;
    }
  }
  return false;
}

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return CpuHasAvx2();
    case Isa::kAvx512: return CpuHasAvx512();
  }
  return false;
}

Isa BestIsa() {
  Isa best = Isa::kScalar;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (IsaSupported(isa)) best = isa;
  }
  if (const char* env = std::getenv("DOS_CPU_ISA"); env != nullptr && *env != '\0') {
    Isa cap;
    if (ParseIsa(env, &cap) && static_cast<int>(cap) < static_cast<int>(best)) best = cap;
  }
  return best;
}

AdamKernelFn AdamKernel(Isa isa) {
  if (!IsaSupported(isa)) return internal::AdamScalarKernel;
  switch (isa) {
    case Isa::kScalar: return internal::AdamScalarKernel;
    case Isa::kAvx2: return internal::AdamAvx2Kernel;
    case Isa::kAvx512:
      return internal::CpuHasAvx512Bf16() ? internal::AdamAvx512Bf16Kernel
                                          : internal::AdamAvx512Kernel;
  }
  return internal::AdamScalarKernel;
}

AdamKernelFn AdamKernel(Isa isa, Stores stores) {
  if (stores == Stores::kCached || isa != Isa::kAvx512 || !IsaSupported(isa)) {
    return AdamKernel(isa);
  }
  const bool bf16 = internal::CpuHasAvx512Bf16();
  if (stores == Stores::kStreamOut) {
    return bf16 ? internal::AdamAvx512Bf16StreamOutKernel : internal::AdamAvx512StreamOutKernel;
  }
  return bf16 ? internal::AdamAvx512Bf16StreamAllKernel : internal::AdamAvx512StreamAllKernel;
}

AllFiniteFn AllFiniteKernel(Isa isa) {
  if (!IsaSupported(isa)) return internal::AllFiniteScalar;
  switch (isa) {
    case Isa::kScalar: return internal::AllFiniteScalar;
    case Isa::kAvx2: return internal::AllFiniteAvx2;
    case Isa::kAvx512: return internal::AllFiniteAvx512;
  }
  return internal::AllFiniteScalar;
}

bool AllFinite(const void* grad, DType dtype, size_t n) {
  static const AllFiniteFn fn = AllFiniteKernel(BestIsa());
  return fn(grad, dtype, n);
}

namespace internal {

bool CpuHasAvx512Bf16() { return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16"); }

std::vector<KernelVariant> AllKernelVariants() {
  return {
      {"scalar", Isa::kScalar, AdamScalarKernel, AllFiniteScalar},
      {"avx2", Isa::kAvx2, AdamAvx2Kernel, AllFiniteAvx2},
      {"avx512", Isa::kAvx512, AdamAvx512Kernel, AllFiniteAvx512},
      {"avx512bf16", Isa::kAvx512, AdamAvx512Bf16Kernel, AllFiniteAvx512},
      {"avx512_ntout", Isa::kAvx512, AdamAvx512StreamOutKernel, AllFiniteAvx512},
      {"avx512_ntall", Isa::kAvx512, AdamAvx512StreamAllKernel, AllFiniteAvx512},
      {"avx512bf16_ntout", Isa::kAvx512, AdamAvx512Bf16StreamOutKernel, AllFiniteAvx512},
      {"avx512bf16_ntall", Isa::kAvx512, AdamAvx512Bf16StreamAllKernel, AllFiniteAvx512},
  };
}

std::vector<KernelVariant> SupportedKernelVariants() {
  std::vector<KernelVariant> out;
  for (const KernelVariant& k : AllKernelVariants()) {
    const bool ok = k.name.starts_with("avx512bf16") ? CpuHasAvx512Bf16() : IsaSupported(k.isa);
    if (ok) out.push_back(k);
  }
  return out;
}

}  // namespace internal
}  // namespace dos::cpu
