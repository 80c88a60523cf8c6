// Engine: what executes step plans for the sessions whose trainer memory it
// can reach. Two implementations: the host engine (daemon/cpu/host_engine.h:
// tensors in shared memory, every subgroup on the CPU) and one GPU engine per
// device (daemon/gpu/gpu_engine.h: tensors in CUDA memory shared by IPC, the
// GPU and the CPU paths under the plan). Tests use a fake
// (tests/unit/sched/fake_engine.h).
//
// The engine decides nothing: the StepPlanner makes the plan, the engine
// executes it and reports what it measured. Each engine owns its mechanism:
// mapping the trainer's memory (NewTransport), readying a shard's state
// (AttachShard: the GPU engine page-locks it), the trainer's event, its
// threads, streams and buffers.
//
// Ownership: an engine outlives every session and executor that uses it.
// Thread-safety: every method is thread-safe; Execute calls of one engine are
// serialised inside it where they share resources.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cpu/adam_kernel.h"
#include "daemon/sched/delayed_host.h"
#include "daemon/sched/step_plan.h"
#include "daemon/state/register_progress.h"
#include "daemon/state/shard_state.h"
#include "daemon/transport/transport.h"

namespace dos {

// Where one registered tensor's trainer memory is mapped in the daemon.
struct TensorBinding {
  void* param = nullptr;        // param_dtype elements, written each step
  const void* grad = nullptr;   // grad_dtype elements, read each step
};

// How one step synchronises with the trainer beyond the doorbells.
struct StepSync {
  // GPU engines: the trainer's IPC event (Engine::OpenTrainerEvent) recorded
  // after its gradients were final; every stream that reads gradients waits
  // on it. Null: the trainer synchronised before ringing.
  void* trainer_event = nullptr;
  // Called once per subgroup as soon as its new weights are in the trainer's
  // memory, from any thread (CUDA host callbacks included): it must be cheap
  // and must not call CUDA. May be empty.
  std::function<void(uint32_t subgroup)> subgroup_done;
  // Returns once subgroup i's gradients are final (its ready word, in
  // dos/wire/control_block.h), or an error when the step can no longer
  // finish (the trainer died, shutdown). Readiness contract: for a plan with
  // `wait_ready` (StepKind::per_subgroup) an engine calls it before it reads
  // a subgroup's gradients or writes its weights, and stops the step at its
  // first error; for any other plan it never calls it or is_ready. Set for
  // such plans (the executor checks).
  std::function<absl::Status(uint32_t subgroup)> wait_ready;
  // The same without waiting (set with wait_ready).
  std::function<bool(uint32_t subgroup)> is_ready;
  // Steps updated per subgroup: true, with the tensors the trainer found
  // without a gradient at step() in `late->skip` (kStepSkipTensors), once it
  // published them. It publishes them before it marks the subgroups that
  // hold them ready, so a subgroup seen ready after they were published is
  // updated with them. The executor applies them (engines never call it).
  // May be empty (none can come).
  std::function<bool(StepRequest* late)> late_skip;
  // A delayed step (plan.delayed not empty): the buffers the engine copies
  // the delayed subgroups' gradients into, after installing the weights
  // pending there for them (DelayedHost::installs), each subgroup marked
  // done once both are complete. Null for any other step.
  DelayedHost* delayed = nullptr;
  // Called once every delayed subgroup's gradients are in `delayed`'s
  // buffers (host-visible), or once their copies are queued where the
  // engine set DelayedHost::await_capture for the update to wait on, from
  // the thread that executes the step, while the rest of the step may still
  // run: the executor starts their update then. May be empty.
  std::function<void()> delayed_captured;
  // Early delayed steps (EarlyCapture; control_block.h, protocols 9 and
  // 10): whether the trainer asked the captures before the verdict to stop
  // (it is about to scale its gradients in place); before each capture, the
  // store that says a copy begins, then whether it may (false: stopped; the
  // trainer, which stores its stop and then reads that store, either waits
  // for this copy or is seen here); after it, the store that says it ended;
  // and the store that tells the trainer no more gradients are read before
  // the verdict. Each may be empty (none asks).
  std::function<bool()> capture_stopped;
  std::function<bool()> capture_begins;
  std::function<void()> capture_ended;
  std::function<void()> captures_done;
  // The coefficient of a verdict with kStepGradientsScaledOnStream (protocol
  // 11), which the trainer's stream copied before its event: read by the
  // executor once that event has completed. May be empty (none can come).
  std::function<float()> stream_coef;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // Plans for this engine may place subgroups on a GPU.
  virtual bool has_gpu() const = 0;
  // The trainer's tensors are addressable by the daemon's CPU (shared
  // memory): weights are converted in place, not through a staging copy.
  virtual bool host_addressable() const = 0;
  // "host" or "cuda:N" (logs, dosctl).
  virtual std::string name() const = 0;

  // A transport that maps the trainer's memory locations this engine reads.
  virtual std::unique_ptr<Transport> NewTransport() = 0;
  // Readies a registered shard's state (GPU: page-locks it; the registration
  // is attached to the shard and undone when it is freed). Once per shard;
  // reports phase kRegisterPinning to `progress` (may be null).
  virtual absl::Status AttachShard(ShardState& shard, RegisterProgress* progress) = 0;
  // The trainer's "gradients ready" event from its cudaIpcEventHandle_t
  // bytes; INVALID_ARGUMENT for a bad handle or an engine without a GPU.
  virtual absl::StatusOr<void*> OpenTrainerEvent(const std::string& handle) = 0;
  virtual void CloseTrainerEvent(void* event) = 0;
  // Makes the engine's work wait (on the GPU) for the event's last record.
  virtual absl::Status WaitTrainerEvent(void* event) = 0;
  // Returns once the event's last record has completed (a wait on the
  // host): what the trainer's stream queued before it, a copy into the
  // control block included, is done.
  virtual absl::Status SyncTrainerEvent(void* event) = 0;

  // Synchronous copies between host memory and trainer memory (registration,
  // state loads). Host engines copy bytes; GPU engines cross PCIe.
  virtual absl::Status CopyToHost(void* dst, const void* trainer_src, uint64_t bytes) = 0;
  virtual absl::Status CopyToTrainer(void* trainer_dst, const void* src, uint64_t bytes) = 0;

  // True when every gradient of every tensor is finite.
  virtual absl::StatusOr<bool> AllFinite(const ShardState& shard,
                                         std::span<const TensorBinding> bindings) = 0;
  // Starts copying the state of the streamed subgroups `plan` gives the GPU
  // first into the engine's staging memory, before the step's gradients are
  // final (the state does not depend on them): called by the step's Run
  // between planning and the verdict (the inf/NaN scan waits for backward
  // to end), it moves that transfer out of the update phase. Only the next
  // Execute of the same shard at the same step count uses it; any other
  // Execute discards it. Engines without staging do nothing.
  virtual absl::Status Prefetch(const StepPlan& plan, ShardState& shard) {
    (void)plan;
    (void)shard;
    return absl::OkStatus();
  }
  // Updates every subgroup of the shard where `plan` puts it, in the order
  // its lists give (waiting for each one's gradients when plan.wait_ready:
  // StepSync), with one AdamScalars per tensor, writes the trainer's weights
  // in place and fills `measured`. When it returns every copy and kernel of
  // the step completed.
  virtual absl::Status Execute(const StepPlan& plan, ShardState& shard,
                               std::span<const TensorBinding> bindings,
                               std::span<const cpu::AdamScalars> scalars, const StepSync& sync,
                               StepMeasurements* measured) = 0;

  // State kept on the GPU between steps (resident subgroups): copied back to
  // the host arrays before the state is read, forgotten after it was
  // replaced. No-ops for engines that keep none.
  virtual absl::Status SyncResidentToHost(ShardState& shard) = 0;
  // Keeps subgroups [0, count) of the shard resident. Subgroups from `count`
  // on that are resident are copied back to the host arrays first and their
  // GPU memory is freed before this returns (a shrink is complete). With
  // `grow`, missing ones are allocated and uploaded, stopping without error
  // at the first the device has no memory for. Returns how many leading
  // subgroups are resident now. Engines without a GPU keep none (0).
  virtual absl::StatusOr<uint32_t> SetResident(ShardState& shard, uint32_t count, bool grow) = 0;
  virtual void DropResident(ShardState& shard) = 0;

  // The delayed host path (delayed_host.h). Host memory for its buffers
  // (GPU engines: page-locked).
  virtual absl::StatusOr<HostBuffer> AllocStaging(uint64_t bytes) = 0;
  // Copies the pending weights of `subgroups` from `delayed` into the
  // trainer's memory (after the trainer's event: WaitTrainerEvent came
  // first); returns once they are in.
  virtual absl::Status InstallDelayed(const ShardState& shard,
                                      std::span<const TensorBinding> bindings,
                                      const DelayedHost& delayed,
                                      std::span<const uint32_t> subgroups) = 0;
  // An early delayed step's captures during backward (early_capture.h):
  // for each of `subgroups`, whose ready words say backward is done with
  // them, the pending weights into the trainer's memory when
  // delayed.installs(sg) (DelayedHost::BeginEarly), then its gradients into
  // `delayed`'s buffers; returns once they are in.
  virtual absl::Status CaptureDelayed(const ShardState& shard,
                                      std::span<const TensorBinding> bindings,
                                      const DelayedHost& delayed,
                                      std::span<const uint32_t> subgroups) = 0;
  // The CPU kernel over the captured subgroups of `delayed` with its
  // scalars: the shard's state of those subgroups becomes the step's and
  // their new weights go into `delayed`'s buffers. Adds the kernel's time
  // to `*kernel_us`.
  virtual absl::Status UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                                     double* kernel_us) = 0;
};

}  // namespace dos
