// StepKind: how one optimizer step meets its trainer, decided once from the
// request's flags where the daemon reads the request (Session::HandleRequest)
// and carried by value from there: the executor runs the step by it, the
// planner orders the plan by it (step_planner.h), and engines see only the
// plan it shaped, never the flags.
//
//   gradients        request flags (dos/wire/control_block.h)   final           hyperparameters
//   kFinal           (neither below)                             at the begin    the request's
//   kAtVerdict       kStepGradientsPending                       at the verdict  the verdict's
//   kPerSubgroup     kStepGradientsPending | kStepNoVerdict      at each ready   the request's
//                    (and kStepGradientsChecked)                 word
//
// `delay` (protocol 7, dos/wire/control_block.h "delayed host path"):
//   kNone        every subgroup is updated before the step completes
//   kHost        kStepDelayHost: the CPU path's subgroups are updated after
//                the result is posted, one step late (not with kPerSubgroup:
//                those steps already update during backward)
//   kFinish      kStepFinishDelayed: no update; the pending weights of the
//                last delayed step are installed (gradients are not read)
//
// `stream_ordered`: the trainer's GPU stream orders the step (the session
// registered a CUDA IPC event): its ready words are written by the stream,
// so no futex wake comes with them. Whether a step runs on the CPU or a GPU
// is not the step's: it is the session's engine, picked once at Register.
//
// The flags that are not the kind (kStepGradientsChecked,
// kStepTrainerEventRecorded, kStepGpuLease, kStepSkipTensors) stay in the
// request; the executor reads them per step.
//
// Thread-safety: a plain value.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dos {

class StepKind {
 public:
  enum class Gradients : uint8_t {
    kFinal,         // synchronous: every gradient is final when the request is read
    kAtVerdict,     // early: final at the verdict, which brings the final request
    kPerSubgroup,   // early without a verdict: each subgroup's at its ready word
  };

  enum class Delay : uint8_t { kNone, kHost, kFinish };

  // A synchronous step, not stream-ordered.
  constexpr StepKind() = default;
  constexpr StepKind(Gradients gradients, bool stream_ordered, Delay delay = Delay::kNone)
      : gradients_(gradients), stream_ordered_(stream_ordered), delay_(delay) {}

  // The kind of a request with `flags`; INVALID_ARGUMENT for unknown bits or
  // a combination no client may send (kStepAbandon outside a verdict,
  // kStepNoVerdict without kStepGradientsPending, an early step without a
  // verdict that did not check its gradients). `stream_ordered`: the session
  // has the trainer's CUDA IPC event.
  static absl::StatusOr<StepKind> Decode(uint32_t flags, bool stream_ordered);

  Gradients gradients() const { return gradients_; }
  // Published before its gradients were final (kStepGradientsPending).
  bool early() const { return gradients_ != Gradients::kFinal; }
  bool awaits_verdict() const { return gradients_ == Gradients::kAtVerdict; }
  // Each subgroup is updated once its ready word says its gradients are final.
  bool per_subgroup() const { return gradients_ == Gradients::kPerSubgroup; }
  bool stream_ordered() const { return stream_ordered_; }
  Delay delay() const { return delay_; }
  // The CPU path's subgroups are updated after the result (kStepDelayHost).
  bool delays_host() const { return delay_ == Delay::kHost; }
  // Installs the pending weights and applies nothing (kStepFinishDelayed).
  bool finishes_delayed() const { return delay_ == Delay::kFinish; }
  // "sync", "verdict" or "per_subgroup" (logs, errors).
  const char* name() const;

  friend bool operator==(const StepKind&, const StepKind&) = default;

 private:
  Gradients gradients_ = Gradients::kFinal;
  bool stream_ordered_ = false;
  Delay delay_ = Delay::kNone;
};

// INVALID_ARGUMENT when `flags` (a request's or, `what` "verdict", a
// verdict's) carry bits this daemon does not know.
absl::Status CheckStepFlags(uint32_t flags, const char* what);

}  // namespace dos
