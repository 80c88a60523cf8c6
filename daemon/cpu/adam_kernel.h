// The CPU Adam/AdamW kernel: one pass over a contiguous run of elements.
//
// A kernel is a plain function over spans; it knows nothing of threads,
// sessions or torch (the CPU updater in cpu_updater.h tiles work across a
// oneTBB arena and calls it). Per element it reads the gradient (fp32, bf16
// or fp16), the fp32 master weight, exp_avg and exp_avg_sq, and writes the
// three fp32 state values plus the trainer's weight in its own dtype (round
// to nearest even).
//
// Numerics follow torch.optim.Adam/AdamW (single-tensor path), in fp32 with
// the per-step scalars computed in double and rounded once to float:
//   g  = float(grad) * inv_grad_scale * clip_coef
//   g += weight_decay * p                       (Adam, L2 mode)
//   p *= decay_factor  (= 1 - lr * wd)          (AdamW, decoupled mode)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p += (-step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)   (addcdiv_ order)
//   out = round_to(param_dtype, p)
// Thread-safety: kernels are pure functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "daemon/common/dtype.h"
#include "proto/dos/v1/control_block.h"

namespace dos::cpu {

// Per-step scalars of one param group at one step count, shared by every
// element of the run.
struct AdamScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float l2_weight_decay;        // Adam (L2) mode; 0 in decoupled mode
  float decay_factor;           // AdamW: 1 - lr * wd; 1 in L2 mode
  float neg_step_size;          // -(lr / (1 - beta1^t))
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float inv_grad_scale;         // float(1 / grad_scale), as AMP computes it
  float clip_coef;
};

// `step` is the 1-based step being applied (after increment).
AdamScalars MakeAdamScalars(const GroupStepParams& group, bool decoupled_weight_decay,
                            int64_t step, double grad_scale, double clip_coef);

// One contiguous run of elements of one tensor.
struct AdamSpan {
  const void* grad;
  DType grad_dtype;
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;  // may be null: no trainer weight to write
  DType param_dtype;
  size_t n;
};

using AdamKernelFn = void (*)(const AdamScalars&, const AdamSpan&);

// Instruction-set variants compiled into the binary; Best() picks from CPUID.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
std::string_view IsaName(Isa isa);
bool ParseIsa(std::string_view text, Isa* out);
// Highest variant this CPU supports, capped by $DOS_CPU_ISA if set to one of
// IsaName()s (anything else there is ignored; the caller may warn).
Isa BestIsa();
bool IsaSupported(Isa isa);
AdamKernelFn AdamKernel(Isa isa);

// True when all n gradients are finite (no inf, no NaN). Uses BestIsa().
bool AllFinite(const void* grad, DType dtype, size_t n);

// The non-finite scan of one variant (AllFinite uses BestIsa()'s).
using AllFiniteFn = bool (*)(const void* grad, DType dtype, size_t n);
AllFiniteFn AllFiniteKernel(Isa isa);

// Bytes of memory traffic one element must cause (gradient, p, m, v read;
// p, m, v and the trainer weight written): what bandwidth figures count.
inline constexpr size_t AdamBytesPerElement(DType grad, DType param) {
  return DTypeSize(grad) + 12 + 12 + DTypeSize(param);
}

}  // namespace dos::cpu
