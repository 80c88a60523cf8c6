// TensorDesc: the one description of a registered tensor, shared by the
// client library, dosd's registration, its optimizer state and its
// checkpoint files. What each part adds lives beside it, not in a copy:
// registration pairs it with where the trainer's memory is (ShardSpec's
// TensorSpec), the state with where it lies in the shard's flat element
// space (ShardState::flat_offset). How the optimizer state is stored (fp32 or
// compact bf16 moments) is the shard's StateFormat, not a tensor's.
//
// Thread-safety: plain data.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "dos/wire/dtype.h"

namespace dos {

struct TensorDesc {
  std::string name;
  DType param_dtype = DType::kF32;  // the trainer's weights
  DType grad_dtype = DType::kF32;   // the trainer's gradients
  uint64_t numel = 0;
  uint32_t group = 0;  // index into the shard's param groups
  int64_t step = 0;    // optimizer steps applied to this tensor (0 at registration)
};

// The step a set of tensors is at: the highest step count among them (0 for
// none). A tensor a trainer froze (or never gives a gradient) stops counting,
// so no single tensor's count stands for the whole state.
inline int64_t LatestStep(std::span<const TensorDesc> tensors) {
  int64_t step = 0;
  for (const TensorDesc& t : tensors) step = std::max(step, t.step);
  return step;
}

}  // namespace dos
