// StepMachine: the life of one step of a client session, as an explicit
// transition table (client/python/dos/_step.py is the model). What kind of
// step is in flight is its phase, decided once when it begins; every call
// of the step API asks the machine, never a set of flags.
//
//   kIdle ──begin──────────────────────> kInFlight ──collect / lose──> kIdle
//   kIdle ──begin early─────────────────> kAwaitingVerdict
//   kIdle ──begin early without verdict─> kAwaitingReady
//   kAwaitingVerdict ──verdict / abandon─> kInFlight
//   kAwaitingReady ──verdict─────────────> kInFlight (its last ready marks)
//
// kInFlight: published in full, the result not collected yet (`collect`:
// dos_step_wait took it; `lose`: the daemon will not finish it). The two
// awaiting phases are early steps (dos/wire/control_block.h) whose
// gradients are still being made: ready marks may come, and the step ends
// with dos_step_verdict (or, with a verdict, dos_step_abandon). Whether the
// session's steps are stream-ordered (GPU mode) is the session's, fixed at
// registration (ClientSession::stream_sync).
//
// Thread-safety: none (the session's one thread).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dos::client {

enum class StepPhase : uint8_t {
  kIdle,
  kAwaitingVerdict,
  kAwaitingReady,
  kInFlight,
};

enum class StepEvent : uint8_t {
  kBegin,
  kBeginEarly,
  kBeginEarlyWithoutVerdict,
  kVerdict,
  kAbandon,
  kCollect,
  kLose,
};

// The request flags (dos/wire/control_block.h) that tell dosd the kind of
// a step begun by `begin` (the daemon's StepKind::Decode reads them back):
// none, kStepGradientsPending, or that with kStepNoVerdict and
// kStepGradientsChecked. 0 for events that begin nothing.
uint32_t BeginFlags(StepEvent begin);

const char* StepPhaseName(StepPhase phase);
const char* StepEventName(StepEvent event);

class StepMachine {
 public:
  StepPhase phase() const { return phase_; }
  // A step was begun and its result is not collected yet.
  bool in_flight() const { return phase_ != StepPhase::kIdle; }
  // An early step whose gradients are still being made (ready marks, then a
  // verdict, may come).
  bool awaiting_gradients() const {
    return phase_ == StepPhase::kAwaitingVerdict || phase_ == StepPhase::kAwaitingReady;
  }
  // The early step in flight takes no verdict (DOS_EARLY_NO_VERDICT).
  bool without_verdict() const { return phase_ == StepPhase::kAwaitingReady; }

  // Takes the transition `event` from the current phase; INTERNAL, naming
  // both, when the table has none (a bug in the library: the step API
  // checks what a caller may do before it acts).
  absl::Status Go(StepEvent event);

 private:
  StepPhase phase_ = StepPhase::kIdle;
};

}  // namespace dos::client
