// What the state-store tests share.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dos/wire/tensor_desc.h"

namespace dos::testing {

// Tensors "t0", "t1", ... of the given sizes, fp32 weights and gradients, group 0.
inline std::vector<TensorDesc> Tensors(const std::vector<uint64_t>& sizes) {
  std::vector<TensorDesc> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(TensorDesc{.name = absl::StrCat("t", i), .numel = sizes[i]});
  }
  return out;
}

}  // namespace dos::testing
