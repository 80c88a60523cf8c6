// The portable kernel. It defines the numerics every vector variant must
// reproduce bit for bit: fp32 operations in the order of adam_kernel.h, no
// fused multiply-add (the library is built with -ffp-contract=off), IEEE
// division and square root, and dtype.h's round-to-nearest-even conversions.
#include <cmath>
#include <cstdint>

#include "daemon/cpu/kernel_dispatch.h"
#include "daemon/cpu/kernel_variants.h"

namespace dos::cpu::internal {
namespace {

template <DType G>
inline float LoadGrad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBF16) {
    return BF16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return F16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <DType P>
inline void StoreParam(void* out, size_t i, float p) {
  if constexpr (P == DType::kF32) {
    static_cast<float*>(out)[i] = p;
  } else if constexpr (P == DType::kBF16) {
    static_cast<uint16_t*>(out)[i] = FloatToBF16(p);
  } else {
    static_cast<uint16_t*>(out)[i] = FloatToF16(p);
  }
}

// kL2 is hoisted out of the loop rather than adding 0 * p in decoupled mode:
// 0 * inf would turn a finite gradient into NaN and -0 + 0 would flip signs
// that PyTorch (which skips the add) keeps.
template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
void Loop(const AdamScalars& s, const AdamSpan& span) {
  float* __restrict master = span.master;
  float* __restrict m_ptr = span.exp_avg;
  float* __restrict v_ptr = span.exp_avg_sq;
  uint16_t* __restrict m16 = span.exp_avg_bf16;
  uint16_t* __restrict v16 = span.exp_avg_sq_bf16;
  for (size_t i = 0; i < span.n; ++i) {
    float g = LoadGrad<G>(span.grad, i);
    float p = master[i];
    if (s.grad_coef != 1.0f) {
      g = g * s.grad_coef;
      if constexpr (G == DType::kBF16) g = BF16ToFloat(FloatToBF16(g));
    }
    g = g * s.inv_grad_scale * s.clip_coef;
    if constexpr (kL2) g = g + s.l2_weight_decay * p;
    p = p * s.decay_factor;
    const float m_old = kCompact ? BF16ToFloat(m16[i]) : m_ptr[i];
    const float v_old = kCompact ? BF16ToFloat(v16[i]) : v_ptr[i];
    const float m = s.beta1 * m_old + s.one_minus_beta1 * g;
    const float v = s.beta2 * v_old + s.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    // (value * m) / denom, in the order torch's addcdiv_ evaluates it.
    p = p + (s.neg_step_size * m) / denom;
    master[i] = p;
    if constexpr (kCompact) {
      m16[i] = FloatToBF16(m);
      v16[i] = StochasticRoundBF16(v, RoundingBits(s.rounding_seed, span.element_offset + i));
    } else {
      m_ptr[i] = m;
      v_ptr[i] = v;
    }
    if constexpr (kWriteOut) StoreParam<P>(span.param_out, i, p);
  }
}

template <DType G>
bool AllFiniteT(const void* grad, size_t n) {
  // Blocks without early exit let the compiler vectorise the inner test; the
  // check between blocks bounds the work after the first non-finite value.
  constexpr size_t kBlock = 1024;
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t end = start + kBlock < n ? start + kBlock : n;
    bool bad = false;
    if constexpr (G == DType::kF32) {
      const uint32_t* g = static_cast<const uint32_t*>(grad);
      for (size_t i = start; i < end; ++i) bad |= (g[i] & 0x7f800000u) == 0x7f800000u;
    } else {
      const uint16_t* g = static_cast<const uint16_t*>(grad);
      constexpr uint16_t kExp = G == DType::kBF16 ? 0x7f80u : 0x7c00u;
      for (size_t i = start; i < end; ++i) bad |= (g[i] & kExp) == kExp;
    }
    if (bad) return false;
  }
  return true;
}

struct ScalarLoop {
  template <DType G, DType P, bool kWriteOut, bool kL2, bool kCompact>
  static void Run(const AdamScalars& s, const AdamSpan& span) {
    Loop<G, P, kWriteOut, kL2, kCompact>(s, span);
  }
};

}  // namespace

void AdamScalarKernel(const AdamScalars& s, const AdamSpan& span) {
  AdamDispatch<ScalarLoop>::Run(s, span);
}

bool AllFiniteScalar(const void* grad, DType dtype, size_t n) {
  switch (dtype) {
    case DType::kF32: return AllFiniteT<DType::kF32>(grad, n);
    case DType::kBF16: return AllFiniteT<DType::kBF16>(grad, n);
    case DType::kF16: return AllFiniteT<DType::kF16>(grad, n);
  }
  return false;
}

}  // namespace dos::cpu::internal
