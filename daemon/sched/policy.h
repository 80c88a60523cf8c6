// Scheduling policies: how each step's subgroups are split between the CPU
// and the GPU (DESIGN.md section 4).
//   cpu                every subgroup on the CPU (ZeRO-Offload's behaviour)
//   static:<fraction>  that fraction of the state resident on the GPU
//   interleave:<k>     every k-th subgroup travels to the GPU (the paper's stride)
//   auto               the measured performance model decides, per step
// Without a GPU every policy runs as `cpu`; the session still reports the
// policy it was given.
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace dos {

struct Policy {
  enum class Kind { kCpu, kStatic, kInterleave, kAuto };
  Kind kind = Kind::kAuto;
  double fraction = 0.0;  // kStatic: share of the state resident on the GPU, in [0, 1]
  int stride = 0;         // kInterleave: k >= 1

  bool operator==(const Policy&) const = default;
};

absl::StatusOr<Policy> ParsePolicy(absl::string_view text);
std::string FormatPolicy(const Policy& policy);

}  // namespace dos
