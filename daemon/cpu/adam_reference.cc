#include "daemon/cpu/adam_reference.h"

#include <cmath>

namespace dos::cpu {
namespace {

double GradAt(const AdamSpan& span, size_t i) {
  switch (span.grad_dtype) {
    case DType::kF32: return static_cast<const float*>(span.grad)[i];
    case DType::kBF16: return BF16ToFloat(static_cast<const uint16_t*>(span.grad)[i]);
    case DType::kF16: return F16ToFloat(static_cast<const uint16_t*>(span.grad)[i]);
  }
  return NAN;
}

}  // namespace

void AdamReference(const ReferenceHyper& h, const AdamSpan& span, ReferenceElement* out) {
  const GroupStepParams& g = h.group;
  const double t = static_cast<double>(h.step);
  const double step_size = g.lr / (1.0 - std::pow(g.beta1, t));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(g.beta2, t));
  const double l2 = h.decoupled_weight_decay ? 0.0 : g.weight_decay;
  const double decay = h.decoupled_weight_decay ? 1.0 - g.lr * g.weight_decay : 1.0;
  const double scale = h.clip_coef / h.grad_scale;
  for (size_t i = 0; i < span.n; ++i) {
    const double p0 = span.master[i];
    const double m0 = span.exp_avg[i];
    const double v0 = span.exp_avg_sq[i];
    const double grad = GradAt(span, i) * scale + l2 * p0;
    const double grad_mag = std::fabs(GradAt(span, i) * scale) + std::fabs(l2 * p0);
    const double m = g.beta1 * m0 + (1.0 - g.beta1) * grad;
    const double m_mag = g.beta1 * std::fabs(m0) + (1.0 - g.beta1) * grad_mag;
    // No cancellation in v (both terms are >= 0): its magnitude is itself.
    const double v = g.beta2 * v0 + (1.0 - g.beta2) * grad * grad;
    const double denom = std::sqrt(v) / bc2_sqrt + g.eps;
    const double update = step_size * m / denom;
    const double update_mag = step_size * m_mag / denom;
    const double p = p0 * decay - update;
    out[i].p = {p, std::fabs(p0 * decay) + update_mag};
    out[i].m = {m, m_mag};
    out[i].v = {v, v};
  }
}

}  // namespace dos::cpu
