// The data plane's wire format: the per-session control block in shared
// memory through which every optimizer step travels (never through gRPC).
//
// The daemon creates the block at Attach (shm name in AttachResponse) and
// both processes map it. Exactly one step is in flight per session:
//
//   client                                   daemon (session's step thread)
//   write request (seq = n)                  wait until request_bell != n-1
//   request_bell.store(n, release) + wake ─▶ read request (acquire), run step
//   wait until done_bell == n         ◀───── write result (seq = n),
//   read result (acquire)                    done_bell.store(n, release) + wake
//
// The bells are futex words (see dos/wire/doorbell.h): waiters spin
// briefly, then sleep in FUTEX_WAIT; ringers FUTEX_WAKE only when the other
// side announced that it sleeps. std::atomic<uint32_t> is lock-free and
// address-free on every platform we build for, so it is valid across
// processes. Everything else is plain data, published by the bells'
// release/acquire ordering.
//
// Per-subgroup progress (the next forward need not wait for the whole step):
// subgroup_done[i] holds the seq of the last step whose new weights for
// subgroup i are in the trainer's memory. The daemon stores it (release) as
// each subgroup finishes, in whatever order the GPU and CPU paths finish
// them, and stores `seq` into every word before it rings done_bell, also when
// the step failed or was skipped, so a waiter is never left behind. In GPU
// mode the trainer's stream waits on these words itself (cuStreamWaitValue32
// on the page-locked block), so the trainer's CPU thread never blocks; on the
// CPU path the trainer polls them. Subgroups from kMaxTrackedSubgroups on
// share the last word, which is stored only when the step ends.
//
// Gradients ready (GPU mode): with kStepTrainerEventRecorded the trainer has
// recorded the IPC event it registered (RegisterShard's cuda_ipc_event) on
// the stream that produced the gradients before ringing request_bell; the
// daemon's streams wait on that event before reading a gradient, so the
// trainer never synchronises its stream for a step.
//
// GPU lease (GPU mode): with kStepGpuLease the request carries the bytes of
// GPU memory the trainer lends dosd from its budget (gpu_lease_bytes), with
// the budget and the trainer's measured peak it was computed from. dosd sizes
// the session's resident tier from it, and before anything else of the step
// it gives back what a smaller lease no longer covers (resident state copied
// back to host memory, GPU memory freed); then it stores the step's seq in
// `lease_bell` (rung, with `lease_client_sleeping`, like done_bell). A client
// that lowered its lease waits for that bell before the trainer allocates
// again, so the tier never takes memory the trainer's next forward needs.
// Without the flag dosd keeps the session's last lease (none: only
// --gpu_memory_budget decides). The bell is rung for every step.
//
// Registration progress: while RegisterShard runs (a 6B shard is ~71 GB of
// state to allocate, fill and page-lock), the daemon publishes its phase and
// bytes in `register_progress`; the trainer's library reads them from another
// thread to log progress. Advisory: relaxed stores, no doorbell.
//
// Early steps (protocol 5): a step may be published before its gradients
// exist, at the first post-accumulate-grad hook of backward, with
// kStepGradientsPending. The client then announces each subgroup whose
// gradients are all final by storing the step's seq in subgroup_ready[i]
// (stream-ordered on CUDA: cuStreamWriteValue32 on the stream that produced
// them, after the gradient kernels; a release store on the CPU path), and the
// daemon reads subgroup i's gradients only once that word reaches seq.
// Subgroups from kMaxTrackedSubgroups - 1 on share the last word, stored once
// all of them are ready. Two kinds:
//  - kStepNoVerdict: the request's hyperparameters are final and nothing
//    global is pending (no loss scale, no clipping, no inf/NaN scan: the
//    client also sets kStepGradientsChecked); the daemon updates each
//    subgroup as soon as it is ready, in readiness order.
//  - otherwise the daemon plans the step and does only what does not depend
//    on the verdict (nothing observable), then waits until verdict_bell
//    reaches seq; `verdict` then holds the step's final request (the same
//    seq; grad_scale, clip_coef, lr and flags as step() gave them, the
//    trainer's event re-recorded after all gradient writes, every ready word
//    stored). A client that abandons the step rings the verdict with
//    kStepAbandon: nothing is applied and the step's result says so.
// The daemon never writes a subgroup's weights before its ready word: the
// trainer's backward no longer reads those parameters by then.
//
// Tensors without a gradient (protocol 6): with kStepSkipTensors, bit i of
// `skip` (word i / 64, bit i % 64) marks tensor i (registration order) as
// having no gradient this step, as torch.optim skips a parameter whose grad
// is None: its master weight, exp_avg, exp_avg_sq and step count stay as
// they are. Only tensors below kMaxSkipTensors can be marked. An early
// step's verdict carries the final mask.
//
// Layout changes bump kProtocolVersion. Both sides check `magic` and
// `version` when they map the block (daemon/transport/control_channel.h) and
// refuse another layout with both versions in the message; Attach carries the
// same number, so a mismatch is caught before any block is mapped.
#pragma once

#include <atomic>
#include <cstdint>

#include "dos/wire/step_params.h"

namespace dos {

inline constexpr uint32_t kControlBlockMagic = 0x31534f44;  // "DOS1"
// 4: the GPU lease; 5: early steps; 6: tensors without a gradient (skip mask);
// 7: the delayed host path (kStepDelayHost, kStepFinishDelayed, ring_ns);
// 8: delayed captures during backward (kStepGradientsRewritten); 9: a verdict's
// coefficient for gradients scaled in place after the captures
// (kStepGradientsScaled, capture_stop, capture_done); 10: the stop waits only
// for a copy in flight (capture_busy); 11: the coefficient through the
// trainer's stream (kStepGradientsScaledOnStream, stream_coef)
inline constexpr uint32_t kProtocolVersion = 11;
inline constexpr uint32_t kMaxGroups = 64;
inline constexpr uint32_t kMaxStatusMessage = 512;
inline constexpr uint32_t kMaxTrackedSubgroups = 4096;
inline constexpr uint32_t kMaxSkipTensors = 4096;  // bits of StepRequest::skip

enum StepFlags : uint32_t {
  // The client already knows every gradient is finite (e.g. AMP's GradScaler
  // checked); the daemon skips its own non-finite scan.
  kStepGradientsChecked = 1u << 0,
  // The trainer recorded its registered IPC event after the gradients were
  // final; the daemon's streams wait on it (GPU mode only).
  kStepTrainerEventRecorded = 1u << 1,
  // gpu_lease_bytes (with gpu_budget_bytes, gpu_peak_bytes) is set: the
  // session's lease from this step on.
  kStepGpuLease = 1u << 2,
  // Published before the gradients are final (early step, above): the
  // daemon waits on subgroup_ready and, without kStepNoVerdict, on
  // verdict_bell.
  kStepGradientsPending = 1u << 3,
  // With kStepGradientsPending: the hyperparameters are final and no global
  // verdict will come; each subgroup is updated as soon as it is ready.
  kStepNoVerdict = 1u << 4,
  // In a verdict: the client gives the step up (an error between backward
  // and step()); the daemon applies nothing and reports ABORTED.
  kStepAbandon = 1u << 5,
  // `skip` marks tensors without a gradient this step (above).
  kStepSkipTensors = 1u << 6,
  // Delayed host path (protocol 7; below): the subgroups the daemon updates
  // on its CPU are updated one step late.
  kStepDelayHost = 1u << 7,
  // Applies nothing: installs the new weights a delayed step left pending
  // (below), then posts the result. Only with kStepTrainerEventRecorded and
  // kStepGpuLease beside it.
  kStepFinishDelayed = 1u << 8,
  // In a verdict of an early delayed step (protocol 8, below): a gradient
  // was written after its subgroup was marked ready (an in-place clip, an
  // unscale, DDP's average); the daemon copies the delayed subgroups'
  // gradients again after the verdict.
  kStepGradientsRewritten = 1u << 9,
  // In a verdict of an early delayed step (protocol 9, below): after the
  // daemon's captures stopped (capture_done), the trainer multiplied every
  // gradient it had marked ready by `gradient_coef`, once, in place (torch's
  // clip_grad_norm_), and wrote them no other way: the daemon keeps what it
  // captured and multiplies it by the coefficient when it updates.
  kStepGradientsScaled = 1u << 10,
  // With kStepGradientsScaled and kStepTrainerEventRecorded (protocol 11):
  // the coefficient is not `gradient_coef` but the float the trainer's
  // stream copied into `stream_coef` before the trainer's event, so that the
  // trainer never waits for its GPU to learn it; a value there that is not
  // finite and >= 0 says the multiply was not one the daemon can repeat, and
  // the daemon copies the gradients again (as kStepGradientsRewritten).
  // With kStepGradientsChecked beside it, a coefficient that is finite and
  // >= 0 also says the norm it came from, over every gradient the step
  // reads, was finite: the daemon skips its scan then and scans otherwise
  // (the trainer sends NaN where its norm was not finite).
  kStepGradientsScaledOnStream = 1u << 11,
};

// The delayed host path (kStepDelayHost): in such a step the daemon updates
// the resident and streamed subgroups at once as always, but for the
// subgroups its plan puts on the CPU (StepResult::delayed_subgroups) it only
// copies the gradients into host memory of its own before it marks them
// done, and posts the result; their update runs after the result is posted,
// during the trainer's next forward and backward, and writes the new weights
// into host memory, not the trainer's. The next request (any kind) first
// waits for that update, then installs those weights into the trainer's
// memory (a delayed step: each subgroup before it is marked done) before
// anything else touches them, so a forward after step t sees the weights of
// step t-1 for the subgroups step t delayed and of step t for the others.
// kStepFinishDelayed installs them without a step (for readers that must see
// whole steps).
// An early delayed step (kStepGradientsPending with kStepDelayHost, protocol
// 8) copies each delayed subgroup's gradients into host memory as soon as
// its ready word says they are final, installing its pending weights first
// (backward no longer reads them), while backward still runs: only what
// does not depend on the verdict, and nothing a trainer reads before its
// next forward. A verdict with kStepGradientsRewritten has them copied
// again; an abandoned step drops them (the weights installed stay: they are
// the last step's). The daemon's own state (state reads, checkpoints, crash
// survival) is never half a step: nothing reads it before the delayed update
// is complete.
// Gradients scaled in place (protocol 9): a trainer about to multiply its
// gradients in place before the verdict (an in-place clip) stores the step's
// seq in `capture_stop`; the daemon then copies no more gradients before the
// verdict. The multiply waits only for a copy in flight (protocol 10): the
// daemon stores seq in `capture_busy` before each copy and then reads
// `capture_stop` again, the trainer stores `capture_stop` and then reads
// `capture_busy` (both sequentially consistent, so at least one of them sees
// the other's store). A trainer that finds no copy of its step begun goes on
// at once: the daemon, when it comes to the step (it may still be updating
// the step before), sees the stop and copies nothing. One that finds a copy
// begun makes the multiply wait until `capture_done` reaches seq (on CUDA its
// stream waits, cuStreamWaitValue32), which the daemon stores once the copies
// it began are complete (also when it copies none, and at the step's end, as
// every progress word). The verdict then carries kStepGradientsScaled with
// the coefficient: a subgroup captured before is updated with its captured
// gradients times the coefficient, rounded as the trainer's multiply rounded
// them (fp32 and bf16 gradients, with grad_scale and clip_coef 1, are kept so;
// others are copied again); one captured after the verdict is copied as the
// multiply left it.

struct StepRequest {
  uint32_t seq;
  uint32_t flags;          // StepFlags
  uint32_t num_groups;     // must equal the number registered
  float gradient_coef;     // kStepGradientsScaled: what the trainer multiplied them by
  double grad_scale;       // gradients are divided by this first (AMP loss scale); 1 = none
  double clip_coef;        // then multiplied by this (clip_grad_norm_); 1 = none
  uint64_t gpu_lease_bytes;   // kStepGpuLease: GPU memory dosd may hold for the session
  uint64_t gpu_budget_bytes;  // the trainer's GPU budget it was computed from (stats)
  uint64_t gpu_peak_bytes;    // the trainer's measured peak (stats)
  GroupStepParams groups[kMaxGroups];
  uint64_t skip[kMaxSkipTensors / 64];  // kStepSkipTensors: tensors without a gradient
  // CLOCK_MONOTONIC nanoseconds when the client published the request, or
  // for a verdict when it gave the verdict (0: unknown; a time the daemon
  // has not reached is ignored): the daemon's measure of the trainer's time
  // between steps.
  uint64_t ring_ns;
};

// True when `r` marks tensor `i` as having no gradient this step.
inline bool SkipsTensor(const StepRequest& r, uint32_t i) {
  return (r.flags & kStepSkipTensors) != 0 && i < kMaxSkipTensors &&
         ((r.skip[i / 64] >> (i % 64)) & 1u) != 0;
}

struct StepResult {
  uint32_t seq;
  int32_t status_code;     // absl::StatusCode; 0 = OK
  uint32_t found_inf;      // 1: non-finite gradients, the step was skipped
  uint32_t early;          // 1: an early step (kStepGradientsPending)
  int64_t step;            // optimizer steps applied so far (the largest tensor count)
  double wall_us;          // doorbell seen to result posted
  double update_us;        // time in the update itself
  // Early steps: request to verdict (0 without a verdict), and verdict (or,
  // without one, request) to the end of the update.
  double before_verdict_us;
  double after_verdict_us;
  uint64_t prefetched_bytes;  // GPU path state copied into staging before the verdict
  // The delayed host path (kStepDelayHost): this step's deferred subgroups
  // and their parameters; the previous delayed update's CPU time and how
  // much of it this step waited for (the rest ran hidden behind the
  // trainer's forward and backward); the trainer's time between steps as
  // the daemon measured it (`window_us`) and the planner's prediction of
  // the update the trainer waits for and of the whole iteration.
  uint32_t delayed_subgroups;
  uint32_t reserved2;
  uint64_t delayed_params;
  double delayed_update_us;
  double delayed_wait_us;
  double window_us;
  double predicted_update_us;
  double predicted_iter_us;
  char message[kMaxStatusMessage];  // NUL-terminated, set when status_code != 0
};

// Phases of a registration, in order (kRegisterPinning in GPU mode only).
enum RegisterPhase : uint32_t {
  kRegisterIdle = 0,            // no registration in flight
  kRegisterAllocating = 1,      // first touch of the fp32 state (zeroed pages)
  kRegisterReadingWeights = 2,  // trainer weights -> fp32 masters
  kRegisterPinning = 3,         // page-locking the state (cudaHostRegister)
};

// "allocating", "reading weights", "pinning"; "" for idle or unknown.
inline const char* RegisterPhaseName(uint32_t phase) {
  switch (phase) {
    case kRegisterAllocating: return "allocating";
    case kRegisterReadingWeights: return "reading weights";
    case kRegisterPinning: return "pinning";
    default: return "";
  }
}

struct RegisterProgressWords {
  std::atomic<uint32_t> phase;           // RegisterPhase
  std::atomic<uint32_t> reserved;
  std::atomic<uint64_t> bytes_done;      // of the current phase
  std::atomic<uint64_t> bytes_total;     // of the current phase
  std::atomic<uint64_t> phase_start_ns;  // CLOCK_MONOTONIC when the phase began
  std::atomic<uint64_t> start_ns;        // CLOCK_MONOTONIC when the registration began
};

struct ControlBlock {
  uint32_t magic;
  uint32_t version;
  uint64_t session_id;
  int32_t daemon_pid;
  int32_t client_pid;

  // Client -> daemon: seq of the last published request.
  alignas(64) std::atomic<uint32_t> request_bell;
  std::atomic<uint32_t> daemon_sleeping;  // daemon is (about to be) in FUTEX_WAIT
  // Daemon -> client: seq of the last posted result.
  alignas(64) std::atomic<uint32_t> done_bell;
  std::atomic<uint32_t> client_sleeping;
  // Set by the daemon when the session is being torn down (shutdown, detach):
  // a waiting client returns UNAVAILABLE instead of waiting forever.
  std::atomic<uint32_t> closed;
  // Daemon -> client: seq of the last step whose lease dosd has applied.
  alignas(64) std::atomic<uint32_t> lease_bell;
  std::atomic<uint32_t> lease_client_sleeping;

  // Client -> daemon: seq of the early step whose verdict is in `verdict`.
  alignas(64) std::atomic<uint32_t> verdict_bell;
  std::atomic<uint32_t> verdict_daemon_sleeping;

  // Gradients scaled in place (protocol 9, above). Client -> daemon: seq of
  // the early delayed step whose captures before the verdict must stop.
  // Daemon -> client: seq of the last step that copies no more gradients
  // before its verdict (polled, no doorbell), and seq of the step whose
  // capture is being copied (0 between copies; protocol 10).
  alignas(64) std::atomic<uint32_t> capture_stop;
  std::atomic<uint32_t> capture_done;
  std::atomic<uint32_t> capture_busy;
  // Client's GPU -> daemon (protocol 11): the coefficient of a verdict with
  // kStepGradientsScaledOnStream, copied by the trainer's stream; the daemon
  // reads it once the trainer's event has completed. A float's bits.
  std::atomic<uint32_t> stream_coef;

  alignas(64) StepRequest request;
  alignas(64) StepRequest verdict;
  alignas(64) StepResult result;

  // Daemon -> client: per-subgroup progress of the step in flight (above).
  alignas(64) std::atomic<uint32_t> subgroup_done[kMaxTrackedSubgroups];

  // Client -> daemon: per-subgroup "gradients final" of an early step (above).
  alignas(64) std::atomic<uint32_t> subgroup_ready[kMaxTrackedSubgroups];

  // Daemon -> client: the registration in flight (above).
  alignas(64) RegisterProgressWords register_progress;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(ControlBlock) < 10 * 4096, "keep the control block within ten pages");

}  // namespace dos
