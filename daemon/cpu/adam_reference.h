// A double-precision Adam/AdamW reference for tests and benchmarks (never on
// the daemon's update path).
//
// It applies one step to the float state of an AdamSpan (read only) with the
// hyperparameters in double, unrounded, and reports each result with the
// magnitude its fp32 rounding error is proportional to: the sum of the
// absolute values of the terms that produce it. A correct fp32 kernel then
// satisfies |kernel - value| <= c * 2^-24 * magnitude for a small c,
// whatever the cancellation between terms. Pure function; thread-safe.
#pragma once

#include <cstdint>

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu {

struct ReferenceHyper {
  GroupStepParams group;
  bool decoupled_weight_decay;
  int64_t step;  // 1-based step being applied
  double grad_scale;
  double clip_coef;
};

struct ReferenceValue {
  double value;
  double magnitude;
};

struct ReferenceElement {
  ReferenceValue p, m, v;
};

// out must hold span.n elements. span.param_out is ignored.
void AdamReference(const ReferenceHyper& hyper, const AdamSpan& span, ReferenceElement* out);

}  // namespace dos::cpu
