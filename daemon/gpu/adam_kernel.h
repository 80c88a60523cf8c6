// The fused GPU Adam/AdamW kernel and the small kernels of the GPU path.
//
// LaunchAdam updates one contiguous run: it reads the gradient in its dtype
// (fp32, bf16, fp16) straight from the trainer's memory (CUDA IPC mapped),
// updates the fp32 master, exp_avg and exp_avg_sq in a staging slot or a
// resident buffer, and writes the trainer's weight in its dtype (round to
// nearest even). The arithmetic is daemon/cpu/adam_kernel.h's, operation for
// operation, with explicitly rounded intrinsics (__fmul_rn, __fadd_rn,
// __fdiv_rn, __fsqrt_rn) so that nvcc cannot contract a multiply and an add
// into an FMA: GPU and CPU results are bitwise equal (tests/gpu checks it for
// every dtype pair). The 16-bit conversions are dtype.h's integer algorithms,
// not the hardware cvt, so NaN payloads and ties match too.
//
// Compact state (DeviceAdamSpan::exp_avg_bf16 set): bf16 moments as in
// daemon/cpu/adam_kernel.h, m rounded to nearest even and v stochastically
// with the same counter-based bits, RoundingBits(rounding_seed,
// element_offset + i): the GPU's bf16 moments equal the CPU's bit for bit.
//
// Thread-safety: launches are asynchronous on the given stream; the caller
// orders them against copies with events.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "dos/wire/dtype.h"
#include "daemon/cpu/adam_kernel.h"

namespace dos::gpu {

// Device pointers of one run (any of them may be IPC-mapped memory of
// another process on the same device).
struct DeviceAdamSpan {
  const void* grad;
  DType grad_dtype;
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;  // null: no trainer weight to write
  DType param_dtype;
  size_t n;
  // Compact state: bf16 moments (both set, exp_avg / exp_avg_sq ignored),
  // and the index of element 0 that the stochastic rounding hashes.
  uint16_t* exp_avg_bf16 = nullptr;
  uint16_t* exp_avg_sq_bf16 = nullptr;
  uint64_t element_offset = 0;
  // At most this many blocks (0: enough to fill every SM several times
  // over). A kernel whose gradients and weights are in page-locked host
  // memory waits on PCIe for its whole run: a grid of every SM would keep the
  // trainer's kernels off the GPU that long (pcie_copy.cu measured that for
  // its copies). The grid-stride loop makes the result the same bit for bit.
  unsigned max_blocks = 0;
};

absl::Status LaunchAdam(const cpu::AdamScalars& s, const DeviceAdamSpan& span,
                        cudaStream_t stream);

// out[i] = float(in[i]) for a 16-bit gradient (the fp32-cast CPU-path variant).
absl::Status LaunchCastToFloat(const void* in, DType dtype, size_t n, float* out,
                               cudaStream_t stream);

}  // namespace dos::gpu
