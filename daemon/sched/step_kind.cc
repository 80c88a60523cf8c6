#include "daemon/sched/step_kind.h"

#include "absl/strings/str_cat.h"
#include "dos/wire/control_block.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

constexpr uint32_t kKnownStepFlags =
    kStepGradientsChecked | kStepTrainerEventRecorded | kStepGpuLease | kStepGradientsPending |
    kStepNoVerdict | kStepAbandon | kStepSkipTensors | kStepDelayHost | kStepFinishDelayed |
    kStepGradientsRewritten | kStepGradientsScaled | kStepGradientsScaledOnStream;

// The delay of a request with `flags` whose gradients are `gradients`.
absl::StatusOr<StepKind::Delay> DecodeDelay(uint32_t flags, StepKind::Gradients gradients) {
  const bool host = (flags & kStepDelayHost) != 0;
  const bool finish = (flags & kStepFinishDelayed) != 0;
  if (finish) {
    constexpr uint32_t kWithFinish =
        kStepFinishDelayed | kStepTrainerEventRecorded | kStepGpuLease;
    if (flags & ~kWithFinish) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step: kStepFinishDelayed (install the pending weights, apply nothing) came with "
          "flags 0x", absl::Hex(flags & ~kWithFinish),
          "; send it alone (kStepTrainerEventRecorded and kStepGpuLease may come with it)"));
    }
    return StepKind::Delay::kFinish;
  }
  if (host && gradients == StepKind::Gradients::kPerSubgroup) {
    return absl::InvalidArgumentError(
        "step: kStepDelayHost with an early step without a verdict (kStepNoVerdict): such a "
        "step already updates each subgroup during backward; send one or the other "
        "(dos.torch: delay= with overlap=\"update\" is not supported)");
  }
  return host ? StepKind::Delay::kHost : StepKind::Delay::kNone;
}

}  // namespace

absl::Status CheckStepFlags(uint32_t flags, const char* what) {
  // The control block's trainer writes them at will.
  if (flags & ~kKnownStepFlags) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: ", what, " flags 0x", absl::Hex(flags), " carry unknown bits 0x",
        absl::Hex(flags & ~kKnownStepFlags), "; this dosd knows 0x", absl::Hex(kKnownStepFlags)));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepKind> StepKind::Decode(uint32_t flags, bool stream_ordered) {
  DOS_RETURN_IF_ERROR(CheckStepFlags(flags, "request"));
  if (flags & kStepAbandon) {
    return absl::InvalidArgumentError(
        "step: request flags carry kStepAbandon, which only a verdict may carry (an early "
        "step's verdict gives the step up); clear it");
  }
  if (flags & (kStepGradientsRewritten | kStepGradientsScaled | kStepGradientsScaledOnStream)) {
    return absl::InvalidArgumentError(
        "step: request flags carry kStepGradientsRewritten or kStepGradientsScaled(OnStream), "
        "which only a verdict may carry (gradients written after their ready marks); clear "
        "them");
  }
  const bool pending = (flags & kStepGradientsPending) != 0;
  const bool no_verdict = (flags & kStepNoVerdict) != 0;
  if (no_verdict && !pending) {
    return absl::InvalidArgumentError(
        "step: request flags carry kStepNoVerdict without kStepGradientsPending; only an "
        "early step can go without a verdict");
  }
  if (no_verdict && !(flags & kStepGradientsChecked)) {
    return absl::InvalidArgumentError(
        "step: an early step without a verdict (kStepNoVerdict) must also set "
        "kStepGradientsChecked: no non-finite scan can see every gradient before the first "
        "subgroup is updated; begin the step at step() to have dosd scan");
  }
  const Gradients gradients = !pending    ? Gradients::kFinal
                              : no_verdict ? Gradients::kPerSubgroup
                                           : Gradients::kAtVerdict;
  DOS_ASSIGN_OR_RETURN(const Delay delay, DecodeDelay(flags, gradients));
  return StepKind(gradients, stream_ordered, delay);
}

const char* StepKind::name() const {
  switch (gradients_) {
    case Gradients::kFinal: return "sync";
    case Gradients::kAtVerdict: return "verdict";
    case Gradients::kPerSubgroup: return "per_subgroup";
  }
  return "?";
}

}  // namespace dos
