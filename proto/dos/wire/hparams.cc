#include "dos/wire/hparams.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace dos {

absl::Status ValidateGroupStepParams(const GroupStepParams& g, size_t group,
                                     absl::string_view where) {
  auto bad = [&](absl::string_view field, double value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": group ", group, " ", field, " = ",
                                                   value, " is invalid; it must be ", want));
  };
  if (!std::isfinite(g.lr) || g.lr < 0) return bad("lr", g.lr, "finite and >= 0");
  if (!(g.beta1 >= 0 && g.beta1 < 1)) return bad("beta1", g.beta1, "in [0, 1)");
  if (!(g.beta2 >= 0 && g.beta2 < 1)) return bad("beta2", g.beta2, "in [0, 1)");
  // The update then divides by sqrt(v)/bc2 alone, as torch's does.
  if (!std::isfinite(g.eps) || g.eps < 0) return bad("eps", g.eps, "finite and >= 0");
  if (!std::isfinite(g.weight_decay) || g.weight_decay < 0) {
    return bad("weight_decay", g.weight_decay, "finite and >= 0");
  }
  return absl::OkStatus();
}

}  // namespace dos
