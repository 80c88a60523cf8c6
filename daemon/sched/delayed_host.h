// DelayedHost: one shard's delayed host path (StepKind::delays_host; the
// protocol is in dos/wire/control_block.h, "delayed host path").
//
// A delayed step's CPU-path subgroups (and with --delayed_gpu_path its
// streamed ones, updated on the GPU from the same buffers: updates_on_gpu)
// go through three stages, each owned by one party:
//   captured   the engine copied the step's gradients into this object's
//              host buffers while executing the step (Engine::Execute with
//              StepSync::delayed), and the step's Adam scalars were kept;
//   updated    after the result was posted, the CPU kernel ran over the
//              captured gradients (Engine::UpdateDelayed): the shard's state
//              is the step's, and the new weights wait in the buffers;
//   installed  the next request copied them into the trainer's memory (the
//              next delayed step's Execute for the subgroups it delays
//              again, Engine::InstallDelayed for every other).
// With --delayed_handoff the update may still run when the next early step
// begins: that step's captures install a subgroup as soon as the update has
// marked it (MarkUpdated), and the join after its verdict leaves it
// installed ("a hand-off", below).
// The buffers: one region per subgroup in the delayed set, sized for the
// shard's largest subgroup, holding its gradients and, after the update,
// its new weights (a subgroup's region is reused step after step; regions
// of subgroups that left the set are reused by others).
//
// Ownership: the session owns one per registered shard, next to it; the
// buffers come from the shard's engine (Engine::AllocStaging: page-locked
// for a GPU engine) and are charged to the HostMemoryBudget the shard's
// state is (--host_memory_limit) from their allocation until this object is
// destroyed (a new shard, a checkpoint load, a resume, the session's end).
// Thread-safety: none; the session's step lock guards it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cpu/adam_kernel.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/state/shard_state.h"

namespace dos {

// Host memory an engine allocated (page-locked for GPU engines), freed by
// its deleter.
using HostBuffer = std::unique_ptr<char, std::function<void(char*)>>;
using AllocHostBuffer = std::function<absl::StatusOr<HostBuffer>(uint64_t bytes)>;

// CLOCK_MONOTONIC now, in nanoseconds (the clock StepRequest::ring_ns uses).
uint64_t MonotonicNs();

class DelayedHost {
 public:
  // `budget` (which must outlive this object): where the buffers are
  // charged, the shard's state's budget; null: nowhere (tests).
  // `session_limit` (--session_memory_limit; 0: none): the session's cap on
  // its state and these buffers together.
  DelayedHost(const ShardState& shard, HostMemoryBudget* budget, uint64_t session_limit = 0);
  // Waits for an update still running (StepExecutor::UpdateDelayed joins it
  // first on every path; this only keeps a forgotten one from terminating).
  ~DelayedHost() {
    if (worker.joinable()) worker.join();
  }
  DelayedHost(const DelayedHost&) = delete;
  DelayedHost& operator=(const DelayedHost&) = delete;

  // Gives each of `subgroups` a region (allocating with `alloc` when the pool
  // has none free), keeping the regions of those whose weights are pending.
  // The regions it allocates are charged to the budget all at once:
  // RESOURCE_EXHAUSTED, naming the bytes, the limit and the fix, when they
  // would pass its limit or, with the shard's state, the session's limit
  // (nothing allocated then), or `alloc` fails (host memory). No subgroup
  // changes stage on failure: the step refused here applied nothing, and a
  // later one places again.
  absl::Status Place(std::span<const uint32_t> subgroups, const AllocHostBuffer& alloc);

  // Where segment `seg` of subgroup `sg` (placed) keeps its gradients and
  // its new weights, in the tensor's grad and param dtypes.
  char* grad(uint32_t sg, const SubgroupSegment& seg) const;
  char* weight(uint32_t sg, const SubgroupSegment& seg) const;
  // The same for the whole subgroup: segment `seg`'s are at
  // seg.subgroup_offset elements of grad_elem() (weight_elem()) bytes each
  // from there, whatever its tensor's dtype.
  char* grad_region(uint32_t sg) const;
  char* weight_region(uint32_t sg) const;
  uint64_t grad_elem() const { return grad_elem_; }
  uint64_t weight_elem() const { return weight_elem_; }

  // Stage bookkeeping (above).
  // Before the step's Execute captures `subgroups`: those among them whose
  // weights are pending are installed by it (installs()), and their update
  // waits, with `scalars`, from then on.
  // `on_gpu` (some of `subgroups`): those the engine updates on the GPU,
  // streamed during the window (StepPlan::delayed_gpu), not on the CPU.
  void BeginCapture(std::span<const uint32_t> subgroups, std::vector<cpu::AdamScalars> scalars,
                    std::span<const uint32_t> on_gpu = {});
  bool updates_on_gpu(uint32_t sg) const { return sg < on_gpu_.size() && on_gpu_[sg]; }
  bool any_on_gpu() const {
    return std::find(on_gpu_.begin(), on_gpu_.end(), true) != on_gpu_.end();
  }
  // Whether the step being executed installs subgroup `sg`'s pending
  // weights before it captures its gradients.
  bool installs(uint32_t sg) const { return sg < installs_.size() && installs_[sg]; }
  // Subgroups captured and not yet updated, and their step's scalars.
  const std::vector<uint32_t>& captured() const { return captured_; }
  const std::vector<cpu::AdamScalars>& scalars() const { return scalars_; }
  // The scalars subgroup `sg`'s update runs with, per tensor: the step's,
  // with grad_coef SetEarlyCoef's coefficient where `sg` was captured early
  // (before the trainer scaled its gradients in place).
  // Fixed at BeginCapture (the early captures are final by then), so that
  // the next step's early captures may change captured_early() while this
  // update still runs (a hand-off, below).
  std::span<const cpu::AdamScalars> scalars_for(uint32_t sg) const {
    return sg < scaled_.size() && scaled_[sg] ? scaled_scalars_ : scalars_;
  }
  // The verdict's kStepGradientsScaled coefficient for the subgroups
  // captured early (StepExecutor::ScaledCoef: the step's grad_scale and
  // clip_coef are 1, its gradients fp32 or bf16); 1: none. Before BeginCapture;
  // DropEarly and Updated forget it.
  void SetEarlyCoef(float coef) { early_coef_ = coef; }
  float early_coef() const { return early_coef_; }
  // After Engine::UpdateDelayed: their weights are pending (those the next
  // step installed during a hand-off, below, are installed); the installs
  // are done. `keep_early`: the next step's early captures (a hand-off's)
  // stay; otherwise they are forgotten with the coefficient (DropEarly).
  void Updated(bool keep_early = false);
  // Subgroups whose new weights wait in the buffers (after Updated), and
  // whether one of them is `sg`.
  const std::vector<uint32_t>& pending() const { return pending_; }
  bool is_pending(uint32_t sg) const { return sg < state_.size() && state_[sg] == kPending; }

  // A hand-off (--delayed_handoff): the next early step begins while this
  // update still runs, and its captures during backward take each subgroup
  // as soon as the update is done with it. The update (Engine::UpdateDelayed,
  // on the worker) marks each subgroup it has written (MarkUpdated: its new
  // weights are in the buffers, its gradients read); the next step's
  // EarlyCapture waits for update_done(sg), then installs those weights
  // (installable) and copies its own gradients over the old. Updated() after
  // the join then leaves them installed.
  void MarkUpdated(uint32_t sg) const { updated_[sg].store(true, std::memory_order_release); }
  bool update_done(uint32_t sg) const {
    return sg >= state_.size() || state_[sg] != kCaptured ||
           updated_[sg].load(std::memory_order_acquire);
  }
  // Whose weights a copy now would install: pending, or updated by the
  // update still running.
  bool installable(uint32_t sg) const {
    return sg < state_.size() &&
           (state_[sg] == kPending ||
            (state_[sg] == kCaptured && updated_[sg].load(std::memory_order_acquire)));
  }
  // Whether the worker's update runs (started, not joined), and whether it
  // has ended (set last by the worker).
  bool update_in_flight() const { return worker.joinable(); }
  // Set by the session when it leaves the update running for the next step
  // (StepExecutor::Run joins it: JoinHandOff); cleared by that join.
  bool handed_off = false;
  // The last hand-off's join: how long the step waited in it, and when it
  // ended (CLOCK_MONOTONIC; 0: none yet), for the debug lines.
  double handoff_join_us = 0;
  uint64_t handoff_joined_ns = 0;
  // The resident count of the step whose update runs: a hand-off's step that
  // keeps it (the engine's tier is that step's) asks the engine nothing.
  uint32_t update_resident = 0;
  bool update_finished() const { return finished_.load(std::memory_order_acquire); }
  void MarkFinished() { finished_.store(true, std::memory_order_release); }
  // Whether the update in flight writes the state of none of `subgroups`
  // outside `keep` (and none below `resident`, the GPU's leading ones): what
  // the next step may plan beside it.
  bool UpdateStaysIn(std::span<const uint32_t> keep) const;
  bool UpdateAbove(uint32_t resident) const;
  // The pending subgroups that are not in `keep` (those the next step
  // installs itself): what must be installed before it runs.
  std::vector<uint32_t> PendingExcept(std::span<const uint32_t> keep) const;
  // After the weights of `subgroups` were installed.
  void Installed(std::span<const uint32_t> subgroups);

  // An early delayed step's captures during backward (EarlyCapture):
  // before the engine copies `subgroups` (Engine::CaptureDelayed), those
  // whose weights are pending are marked to be installed (installs());
  // after, they are installed and their gradients are in the buffers
  // (captured_early()), which the step's own capture then skips. DropEarly
  // forgets the gradients (a verdict that rewrote them, a step given up or
  // skipped); Updated() forgets them too.
  void BeginEarly(std::span<const uint32_t> subgroups);
  void EarlyCaptured(std::span<const uint32_t> subgroups);
  // (Atomic: a thread may ask while EarlyCapture's marks them.)
  bool captured_early(uint32_t sg) const {
    return sg < state_.size() && early_[sg].load(std::memory_order_acquire);
  }
  void DropEarly();

  // Bytes of host memory the regions hold.
  uint64_t bytes() const { return static_cast<uint64_t>(regions_.size()) * region_bytes_; }

  // Timing between steps: when the last delayed update ended and how long
  // it took (StepExecutor::UpdateDelayed); the trainer's time between steps
  // as last measured, smoothed (0: not yet; the session keeps it); the
  // resident cap a delayed `auto` plan keeps (-1: none yet).
  uint64_t update_end_ns = 0;  // CLOCK_MONOTONIC (MonotonicNs)
  double update_us = 0;
  // Of update_us, the CPU kernel's own time over its `kernel_params` (the
  // rest: waits for captures and installs, the GPU's share beside it).
  double kernel_us = 0;
  uint64_t kernel_params = 0;
  double window_us = 0;
  // The window as measured while no delayed update ran beside it (after an
  // exact step: the warm-up's), and whether the window now running has one
  // beside it. The update slows the trainer (on nvidia-h200 a 7B fp32
  // update of 0.68 s stretched the Hugging Face Trainer's forward and
  // backward from 0.25 to about 0.6 s), so a budget taken from the stretched
  // window delays more, which stretches it further: plans take the smaller
  // of the two (PlanWindowUs).
  double clean_window_us = 0;
  bool window_loaded = false;
  // A window sample (us) for the smoothed figures above.
  void NoteWindowSample(double sample_us);
  double PlanWindowUs() const {
    return clean_window_us > 0 ? std::min(window_us, clean_window_us) : window_us;
  }
  int64_t resident_cap = -1;
  // When the last early delayed step's verdict came (CLOCK_MONOTONIC; 0:
  // none): that step's window ends there, not at its begin.
  uint64_t verdict_ns = 0;
  // The verdict of the step whose update runs or ran last (0: that step was
  // not early): what its start is measured against.
  uint64_t update_verdict_ns = 0;
  // Whether the last verdict said the trainer wrote its gradients after
  // their ready marks (kStepGradientsRewritten: an in-place clip, as the
  // Hugging Face Trainer's through torch's clip_grad_norm_): then the next
  // early step copies only the pending weights during backward, not
  // gradients its verdict would most likely drop again.
  bool gradients_rewritten = false;
  // The update of the captured subgroups, when it started as soon as they
  // were captured (StepExecutor: while the step's GPU path still runs), and
  // what it reports (read after the join; update_us and update_end_ns keep
  // the previous update's meanwhile).
  struct Run {
    absl::Status status;
    double us = 0;
    uint64_t end_ns = 0;
    double kernel_us = 0;
    uint64_t kernel_params = 0;
  };
  std::thread worker;
  Run worker_run;
  // Set by an engine whose captures may still be copying when the update
  // starts (GpuEngine::CaptureLoop starts it once they are queued): waits
  // until subgroup `sg`'s gradients are in the buffers and its pending
  // weights (which the update overwrites) are installed. None: all are.
  // Cleared by BeginCapture and Updated.
  std::function<absl::Status(uint32_t sg)> await_capture;

 private:
  // kInstalled: captured, updated, and its new weights already installed by
  // the next step's early captures (a hand-off); none after Updated().
  enum Stage : uint8_t { kNone, kCaptured, kPending, kInstalled };
  // Adds `count` regions from `alloc` to the free pool, charged to budget_
  // (all or none) until each is freed.
  absl::Status Grow(uint64_t count, const AllocHostBuffer& alloc);
  // `buf` whose deleter also gives its charge back to budget_.
  HostBuffer Charged(HostBuffer buf) const;

  HostMemoryBudget* const budget_;
  const uint64_t session_limit_;
  const uint64_t state_bytes_;  // the shard's state as charged (AllocatedBytes)
  uint64_t grad_elem_ = 2, weight_elem_ = 2, max_numel_ = 0, region_bytes_ = 0;
  std::vector<HostBuffer> regions_;
  std::vector<uint32_t> free_;            // region indices not in use
  std::vector<int32_t> region_of_;        // per subgroup; -1: none
  std::vector<Stage> state_;              // per subgroup
  std::vector<uint32_t> captured_, pending_;
  std::vector<bool> installs_;
  std::vector<bool> on_gpu_;                    // per subgroup, while captured
  std::unique_ptr<std::atomic<bool>[]> early_;  // per subgroup: captured during backward
  std::unique_ptr<std::atomic<bool>[]> updated_;  // per subgroup: MarkUpdated
  std::atomic<bool> finished_{false};
  std::vector<bool> scaled_;  // per subgroup, from BeginCapture: scalars_for's choice
  float early_coef_ = 1.0f;
  std::vector<cpu::AdamScalars> scaled_scalars_;  // scalars_ with grad_coef early_coef_
  std::vector<cpu::AdamScalars> scalars_;
};

}  // namespace dos
