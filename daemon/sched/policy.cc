#include "daemon/sched/policy.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace dos {
namespace {
absl::Status BadPolicy(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("policy \"", text, "\": ", why,
                   "; expected one of cpu, static:<fraction in [0,1]>, interleave:<k >= 1>, auto"));
}
}  // namespace

absl::StatusOr<Policy> ParsePolicy(absl::string_view text) {
  Policy p;
  absl::string_view rest = text;
  if (text == "cpu") {
    p.kind = Policy::Kind::kCpu;
  } else if (text == "auto") {
    p.kind = Policy::Kind::kAuto;
  } else if (absl::ConsumePrefix(&rest, "static:")) {
    p.kind = Policy::Kind::kStatic;
    if (!absl::SimpleAtod(rest, &p.fraction) || !std::isfinite(p.fraction) || p.fraction < 0 ||
        p.fraction > 1) {
      return BadPolicy(text, "the fraction is not a number in [0, 1]");
    }
  } else if (absl::ConsumePrefix(&rest, "interleave:")) {
    p.kind = Policy::Kind::kInterleave;
    if (!absl::SimpleAtoi(rest, &p.stride) || p.stride < 1) {
      return BadPolicy(text, "the stride is not an integer >= 1");
    }
  } else {
    return BadPolicy(text, "unknown policy");
  }
  return p;
}

std::string FormatPolicy(const Policy& p) {
  switch (p.kind) {
    case Policy::Kind::kCpu: return "cpu";
    case Policy::Kind::kAuto: return "auto";
    case Policy::Kind::kStatic: return absl::StrCat("static:", p.fraction);
    case Policy::Kind::kInterleave: return absl::StrCat("interleave:", p.stride);
  }
  return "auto";
}

}  // namespace dos
