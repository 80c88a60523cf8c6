// The one walk from a subgroup to the AdamSpans the kernels take: each
// segment (a run of one tensor inside the subgroup) becomes a span over the
// subgroup's [master | exp_avg | exp_avg_sq] state (fp32 or compact),
// wherever that state is
// (the host arrays, a GPU staging slot, a resident GPU copy), and over the
// gradients and weights the caller names for it (the trainer's memory, or
// pinned copies of it).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "daemon/cpu/adam_kernel.h"
#include "daemon/state/shard_state.h"

namespace dos::cpu {

// Element `elems` of an array of `dtype` at `base`.
inline char* ElementAt(const void* base, DType dtype, uint64_t elems) {
  return const_cast<char*>(static_cast<const char*>(base)) + elems * DTypeSize(dtype);
}

// Where one segment's gradients come from and its weights go.
struct SegmentIo {
  const void* grad;
  DType grad_dtype;
  void* param_out;
  DType param_dtype;
};

// The trainer's own memory for a segment (grad and param bases of its tensor).
inline SegmentIo TrainerIo(const TensorDesc& t, const SubgroupSegment& seg, const void* grad,
                           void* param) {
  return SegmentIo{ElementAt(grad, t.grad_dtype, seg.tensor_offset), t.grad_dtype,
                   ElementAt(param, t.param_dtype, seg.tensor_offset), t.param_dtype};
}

// Calls `fn(seg, span)` for every segment of `g`, `state` holding the
// subgroup's three arrays back to back in g.format (g.numel each: fp32
// moments, or bf16 ones in compact format) and `io(seg, tensor)` giving its
// gradients and weights. Stops at the first error `fn` returns.
//
// Compact state's stochastic rounding counts elements by their index in the
// shard's flat space (g.flat_begin + offset), so every path (CPU, GPU
// streamed, GPU resident), every subgroup size and every tiling draws the
// same random bits for an element at a step.
template <typename IoFn, typename Fn>
absl::Status ForEachSegmentSpan(std::span<const TensorDesc> tensors, const Subgroup& g,
                                void* state_base, IoFn&& io, Fn&& fn) {
  float* const state = static_cast<float*>(state_base);
  const bool compact = g.format == StateFormat::kCompact;
  uint16_t* const moments16 = reinterpret_cast<uint16_t*>(state + g.numel);
  for (const SubgroupSegment& seg : g.segments) {
    const SegmentIo sio = io(seg, tensors[seg.tensor]);
    const uint64_t o = seg.subgroup_offset;
    const AdamSpan span{.grad = sio.grad,
                        .grad_dtype = sio.grad_dtype,
                        .master = state + o,
                        .exp_avg = compact ? nullptr : state + g.numel + o,
                        .exp_avg_sq = compact ? nullptr : state + 2 * g.numel + o,
                        .param_out = sio.param_out,
                        .param_dtype = sio.param_dtype,
                        .n = seg.count,
                        .exp_avg_bf16 = compact ? moments16 + o : nullptr,
                        .exp_avg_sq_bf16 = compact ? moments16 + g.numel + o : nullptr,
                        .element_offset = g.flat_begin + o};
    absl::Status st = fn(seg, span);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace dos::cpu
