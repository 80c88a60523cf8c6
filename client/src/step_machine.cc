#include "step_machine.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "dos/wire/control_block.h"

namespace dos::client {
namespace {

struct Transition {
  StepPhase from;
  StepEvent event;
  StepPhase to;
};

// (phase, event) -> next phase; anything else is illegal.
constexpr Transition kTransitions[] = {
    {StepPhase::kIdle, StepEvent::kBegin, StepPhase::kInFlight},
    {StepPhase::kIdle, StepEvent::kBeginEarly, StepPhase::kAwaitingVerdict},
    {StepPhase::kIdle, StepEvent::kBeginEarlyWithoutVerdict, StepPhase::kAwaitingReady},
    {StepPhase::kAwaitingVerdict, StepEvent::kVerdict, StepPhase::kInFlight},
    {StepPhase::kAwaitingVerdict, StepEvent::kAbandon, StepPhase::kInFlight},
    {StepPhase::kAwaitingReady, StepEvent::kVerdict, StepPhase::kInFlight},
    {StepPhase::kInFlight, StepEvent::kCollect, StepPhase::kIdle},
    {StepPhase::kInFlight, StepEvent::kLose, StepPhase::kIdle},
};

std::optional<StepPhase> Next(StepPhase from, StepEvent event) {
  for (const Transition& t : kTransitions) {
    if (t.from == from && t.event == event) return t.to;
  }
  return std::nullopt;
}

}  // namespace

uint32_t BeginFlags(StepEvent begin) {
  switch (begin) {
    case StepEvent::kBeginEarly: return kStepGradientsPending;
    case StepEvent::kBeginEarlyWithoutVerdict:
      // No verdict brings a scan: the client vouches for the gradients.
      return kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
    default: return 0;
  }
}

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kIdle: return "idle";
    case StepPhase::kAwaitingVerdict: return "awaiting its verdict";
    case StepPhase::kAwaitingReady: return "awaiting its gradients (no verdict)";
    case StepPhase::kInFlight: return "in flight";
  }
  return "?";
}

const char* StepEventName(StepEvent event) {
  switch (event) {
    case StepEvent::kBegin: return "begin";
    case StepEvent::kBeginEarly: return "begin early";
    case StepEvent::kBeginEarlyWithoutVerdict: return "begin early without a verdict";
    case StepEvent::kVerdict: return "verdict";
    case StepEvent::kAbandon: return "abandon";
    case StepEvent::kCollect: return "collect";
    case StepEvent::kLose: return "lose";
  }
  return "?";
}

absl::Status StepMachine::Go(StepEvent event) {
  const std::optional<StepPhase> next = Next(phase_, event);
  if (!next) {
    return absl::InternalError(absl::StrCat(
        "libdos_client: illegal step transition '", StepEventName(event), "' in phase '",
        StepPhaseName(phase_), "'; this is a bug in the client library, please report it"));
  }
  phase_ = *next;
  return absl::OkStatus();
}

}  // namespace dos::client
