#include <cmath>

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu {

// Every scalar is formed in double and rounded to float once, as PyTorch
// does when a Python float multiplies a float32 tensor, so the fp32 element
// math sees the same operands as torch.optim.Adam/AdamW's single-tensor path.
AdamScalars MakeAdamScalars(const GroupStepParams& group, bool decoupled_weight_decay,
                            int64_t step, double grad_scale, double clip_coef) {
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(group.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(group.beta2, t);
  AdamScalars s;
  s.beta1 = static_cast<float>(group.beta1);
  s.beta2 = static_cast<float>(group.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - group.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - group.beta2);
  s.eps = static_cast<float>(group.eps);
  s.l2_weight_decay = decoupled_weight_decay ? 0.0f : static_cast<float>(group.weight_decay);
  s.decay_factor =
      decoupled_weight_decay ? static_cast<float>(1.0 - group.lr * group.weight_decay) : 1.0f;
  s.neg_step_size = static_cast<float>(-(group.lr / bias_correction1));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  // AMP's GradScaler unscales with float(1 / double(scale)).
  s.inv_grad_scale = static_cast<float>(1.0 / grad_scale);
  s.clip_coef = static_cast<float>(clip_coef);
  // A different stream of rounding bits each step (compact state only).
  s.rounding_seed = RoundingBits(0x5eed1234u, static_cast<uint64_t>(step)) << 16 |
                    RoundingBits(0x0badf00du, static_cast<uint64_t>(step));
  return s;
}

AdamScalars KeepAdamScalars() {
  AdamScalars s;
  s.beta1 = 1.0f;
  s.beta2 = 1.0f;
  s.one_minus_beta1 = 0.0f;
  s.one_minus_beta2 = 0.0f;
  s.eps = 1.0f;
  s.l2_weight_decay = 0.0f;
  s.decay_factor = 1.0f;
  s.neg_step_size = 0.0f;
  s.bias_correction2_sqrt = 1.0f;
  s.inv_grad_scale = 1.0f;
  s.clip_coef = 0.0f;
  s.rounding_seed = 0;
  return s;
}

}  // namespace dos::cpu
