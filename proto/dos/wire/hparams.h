// The one check of a param group's Adam hyperparameters, shared by every
// entry point: the client library before it registers or steps, dosd at
// registration and at every step. torch.optim.Adam(W)'s rules: lr >= 0,
// betas in [0, 1), eps >= 0 (eps = 0 is valid: torch accepts it), and
// weight_decay >= 0, every value finite.
//
// Thread-safety: a pure function.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "dos/wire/step_params.h"

namespace dos {

// INVALID_ARGUMENT "<where>: group <group> <field> = <value> is invalid; it
// must be <rule>" for the first field outside the rules; `where` is
// "register" or "step".
absl::Status ValidateGroupStepParams(const GroupStepParams& g, size_t group,
                                     absl::string_view where);

}  // namespace dos
