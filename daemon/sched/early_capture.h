// EarlyCapture: an early delayed step's captures during backward
// (dos/wire/control_block.h, "delayed host path", protocol 8).
//
// An early step (StepKind::awaits_verdict) that delays the host path knows
// its plan before the verdict. While the executor waits for the verdict,
// this copies each delayed subgroup whose ready word says backward is done
// with it: its pending weights (the last delayed update's) into the
// trainer's memory, then its gradients into the DelayedHost's buffers
// (Engine::CaptureDelayed), one subgroup at a time as each becomes ready
// (backward frees the last layers first; the first ready in plan order),
// until the verdict or until the trainer asks them to stop (sync.capture_stopped:
// it is about to scale its gradients in place, kStepGradientsScaled; asked
// again after each copy says it begins, sync.capture_begins, since that
// trainer waits only for a copy it saw begun), and then tells it none is
// copying any more (sync.captures_done, also when there was nothing to
// copy). Beside an update handed off to this step (DelayedHost, "a
// hand-off"), a subgroup is also waited for until that update is done with
// it, and the weights it installs are that update's. The step's own
// capture after the verdict then skips them
// (DelayedHost::captured_early), so the copies leave the time the trainer
// waits for the step. Nothing here depends on the verdict: the weights are
// those the next request would install anyway, and the gradients are only
// read by the update the verdict allows (a verdict that says they were
// written after their ready marks, kStepGradientsRewritten, has the step
// copy them again: DelayedHost::DropEarly). Without `gradients` (the last
// verdict said so: DelayedHost::gradients_rewritten) only the pending
// weights are copied: copies a rewrite drops cost PCIe and host memory
// while backward and the delayed update run, and the verdict waits for
// the last of them.
//
// Ownership: the executor's, for one step; it borrows everything. The
// thread it starts only touches the DelayedHost (whose owner, the session,
// holds the step lock and does not touch it until Stop) and the engine.
// Thread-safety: construct, then Stop, from one thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "daemon/sched/delayed_host.h"
#include "daemon/sched/engine.h"
#include "daemon/state/shard_state.h"

namespace dos {

class EarlyCapture {
 public:
  // Starts copying `subgroups` (the plan's delayed list, placed in
  // `delayed`) as `sync.is_ready` finds them ready: their pending weights,
  // and their gradients when `gradients`.
  EarlyCapture(Engine* engine, const ShardState& shard, std::span<const TensorBinding> bindings,
               std::span<const uint32_t> subgroups, const StepSync& sync, DelayedHost* delayed,
               bool gradients = true);
  ~EarlyCapture() { (void)Stop(); }
  EarlyCapture(const EarlyCapture&) = delete;
  EarlyCapture& operator=(const EarlyCapture&) = delete;

  // Stops copying (the verdict came, or the step ended): lets the subgroup
  // in progress finish and joins (the step copies the rest); the first copy
  // error, if any (then nothing it copied counts: the step's capture copies
  // all).
  absl::Status Stop();
  // Subgroups copied so far (after Stop: in all).
  uint32_t copied() const { return copied_.load(std::memory_order_acquire); }

 private:
  void Loop();
  // One run of ready subgroups: copied as the constructor says.
  absl::Status CopyRun(std::span<const uint32_t> run);

  Engine* const engine_;
  const ShardState& shard_;
  const std::span<const TensorBinding> bindings_;
  const std::vector<uint32_t> subgroups_;
  const StepSync& sync_;
  DelayedHost* const delayed_;
  const bool gradients_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> copied_{0};
  absl::Status status_;  // the thread's; read after the join
  std::thread thread_;
  bool joined_ = false;
};

}  // namespace dos
