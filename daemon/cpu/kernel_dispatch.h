// AdamDispatch: turns an AdamSpan's run-time choices (gradient dtype, weight
// dtype or no weight, L2 or decoupled decay, fp32 or compact bf16 state) into
// the compile-time parameters of one ISA's element loop, so each loop is
// specialised and branch-free.
//
// Every ISA's translation unit instantiates it with its own loop type, whose
// static template `Run<G, P, kWriteOut, kL2, kCompact>(scalars, span)` is
// compiled with that unit's instruction-set flags; this header therefore holds
// templates only. Pure functions; thread-safe.
#pragma once

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu::internal {

template <typename LoopT>
struct AdamDispatch {
  static void Run(const AdamScalars& s, const AdamSpan& span) {
    switch (span.grad_dtype) {
      case DType::kF32: return Param<DType::kF32>(s, span);
      case DType::kBF16: return Param<DType::kBF16>(s, span);
      case DType::kF16: return Param<DType::kF16>(s, span);
    }
  }

 private:
  template <DType G>
  static void Param(const AdamScalars& s, const AdamSpan& span) {
    if (span.param_out == nullptr) return Mode<G, DType::kF32, false>(s, span);
    switch (span.param_dtype) {
      case DType::kF32: return Mode<G, DType::kF32, true>(s, span);
      case DType::kBF16: return Mode<G, DType::kBF16, true>(s, span);
      case DType::kF16: return Mode<G, DType::kF16, true>(s, span);
    }
  }

  template <DType G, DType P, bool kWriteOut>
  static void Mode(const AdamScalars& s, const AdamSpan& span) {
    const bool compact = IsCompact(span);
    if (s.l2_weight_decay != 0.0f) {
      compact ? LoopT::template Run<G, P, kWriteOut, true, true>(s, span)
              : LoopT::template Run<G, P, kWriteOut, true, false>(s, span);
    } else {
      compact ? LoopT::template Run<G, P, kWriteOut, false, true>(s, span)
              : LoopT::template Run<G, P, kWriteOut, false, false>(s, span);
    }
  }
};

}  // namespace dos::cpu::internal
