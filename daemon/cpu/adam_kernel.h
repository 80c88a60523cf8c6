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
//   g  = round_to(grad_dtype, float(grad) * grad_coef)   (only when grad_coef != 1)
//   g  = g * inv_grad_scale * clip_coef
//   g += weight_decay * p                       (Adam, L2 mode)
//   p *= decay_factor  (= 1 - lr * wd)          (AdamW, decoupled mode)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p += (-step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)   (addcdiv_ order)
//   out = round_to(param_dtype, p)
//
// Compact state (optional, AdamSpan::exp_avg_bf16 set): m and v are held as
// bf16, 8 instead of 12 bytes of state per element. The step computes in fp32
// exactly as above (m and v widened exactly from bf16), updates p with the
// unrounded fp32 m and v, and stores
//   m -> bf16, round to nearest even (dtype.h's FloatToBF16)
//   v -> bf16, stochastic rounding: round up with probability equal to the
//        discarded fraction, from 16 random bits hash(rounding_seed, index)
//        (stochastic_round.h: RoundingBits, StochasticRoundBF16).
// Why v is rounded stochastically: with beta2 = 0.999 one step changes v by
// about 0.1% of itself, less than half a bf16 ulp (2^-9 to 2^-8 relative), so
// nearest rounding returns the old value: v stops decaying and only grows on
// large gradients (a running maximum), which shrinks every later update.
// Stochastic rounding is unbiased (E[round(v)] = v), so the moving average
// keeps its expected value. m moves by ~10% a step (beta1 = 0.9), far above an
// ulp, so nearest rounding (deterministic, no extra noise) serves it. The
// random bits depend only on (rounding_seed, element_offset + i), so every
// variant, tiling and thread count gives the same bits. Measured effect:
// bench/cpu_adam/README.md.
// Thread-safety: kernels are pure functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "daemon/cpu/stochastic_round.h"
#include "dos/wire/dtype.h"
#include "dos/wire/step_params.h"

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
  uint32_t rounding_seed;       // compact state: the step's stochastic-rounding seed
  // The gradient as the trainer's in-place multiply by this left it, fp32 or
  // rounded to nearest even into bf16 (torch's clip_grad_norm_ after dosd
  // copied the gradients: DelayedHost::scalars_for); 1: none. Never set for
  // fp16 gradients (StepExecutor::ScaledCoef), which are not rounded here.
  float grad_coef = 1.0f;
};

// `step` is the 1-based step being applied (after increment).
AdamScalars MakeAdamScalars(const GroupStepParams& group, bool decoupled_weight_decay,
                            int64_t step, double grad_scale, double clip_coef);

// Scalars under which a kernel (every CPU variant, and the GPU kernel, which
// evaluates the same formula) leaves p, m, v and the trainer's weight exactly
// as they are: for a tensor without a gradient this step (torch.optim skips a
// parameter whose grad is None). With clip_coef = 0, g = 0; then
// m = 1*m + 0*g = m, v = 1*v + 0*g*g = v, p = 1*p + (0*m) / (sqrt(v) + 1) = p,
// exact for finite gradients and state (a non-finite gradient fails the
// step's scan first); eps = 1 keeps the denominator >= 1 where v = 0, also
// for a group with eps = 0. The compact format's roundings return a value
// that is already bf16 unchanged, and the weight is written from the
// unchanged master. No kernel needs to know.
AdamScalars KeepAdamScalars();

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
  // Compact state: when exp_avg_bf16 is set, m and v live here as bf16
  // (exp_avg_sq_bf16 must be set too) and exp_avg / exp_avg_sq are ignored.
  uint16_t* exp_avg_bf16 = nullptr;
  uint16_t* exp_avg_sq_bf16 = nullptr;
  // Index of element 0 within its tensor: the counter the stochastic
  // rounding hashes (sub-spans of one run must carry their own offset).
  uint64_t element_offset = 0;
};

inline bool IsCompact(const AdamSpan& s) { return s.exp_avg_bf16 != nullptr; }

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

// How the kernel writes its results. Non-temporal ("streaming") stores write
// whole lines without reading them first (no read-for-ownership) and keep
// the streams out of the caches: for runs far larger than the last-level
// cache. Results are bit-identical whichever is chosen; only the AVX-512
// kernels have streaming forms (other ISAs ignore the choice). A call that
// streamed ends with an sfence, so its results are globally visible before
// the caller signals completion.
enum class Stores {
  kCached = 0,     // ordinary stores
  kStreamOut = 1,  // non-temporal stores for the trainer weight only
  kStreamAll = 2,  // non-temporal stores for p, m, v and the trainer weight
};
AdamKernelFn AdamKernel(Isa isa, Stores stores);

// True when all n gradients are finite (no inf, no NaN). Uses BestIsa().
bool AllFinite(const void* grad, DType dtype, size_t n);

// The non-finite scan of one variant (AllFinite uses BestIsa()'s).
using AllFiniteFn = bool (*)(const void* grad, DType dtype, size_t n);
AllFiniteFn AllFiniteKernel(Isa isa);

// Bytes of memory traffic one element must cause (gradient, p, m, v read;
// p, m, v and the trainer weight written): what bandwidth figures count.
// compact: bf16 m and v (8 bytes of state read and written instead of 12).
inline constexpr size_t AdamBytesPerElement(DType grad, DType param, bool compact = false) {
  const size_t state = compact ? 8 : 12;
  return DTypeSize(grad) + state + state + DTypeSize(param);
}

}  // namespace dos::cpu
