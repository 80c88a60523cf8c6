// Private to daemon/gpu: one step's working state shared by the GPU path
// (gpu_stream_path.cc, on the engine's worker) and the CPU path
// (gpu_cpu_path.cc, on the step's thread), the per-shard attachment
// (gpu_shard.cc), and small CUDA helpers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/gpu/cuda_check.h"
#include "daemon/gpu/gpu_engine.h"
#include "daemon/sched/subgroup_queue.h"
#include "dos/wire/status_macros.h"

namespace dos::gpu {

// Pinned gradient/weight buffers of the CPU path, used round robin. Four, not
// two: a finished subgroup's weights wait in the H2D queue behind the GPU
// path's state copies (tens of ms), and the CPU must not stall on reusing
// their buffer meanwhile (measured on nvidia-h200: with two, the CPU kernel
// sat idle for about a tenth of an `auto` step).
inline constexpr int kCpuBuffers = 4;
// Bytes per element reserved in the CPU path's pinned buffers: the widest
// dtype, so one layout (element offset * 4) serves every tensor of a subgroup.
inline constexpr uint64_t kHostElemBytes = 4;

// Bytes of one subgroup's whole state in its shard's format (12 or 8 a
// parameter): what crosses PCIe each way for a streamed subgroup and what a
// resident copy takes.
inline uint64_t StateBytes(const Subgroup& g) { return g.state_bytes(); }

// Microseconds from `start` to `ev` (both complete).
inline double EventUs(cudaEvent_t start, cudaEvent_t ev) {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, start, ev) != cudaSuccess) return 0;
  return ms * 1e3;
}

// Events the host may wait for (cudaEventSynchronize) are made with
// cudaEventBlockingSync: without it the waiting thread busy-waits on a core
// whatever the device's flags (cudaDeviceScheduleBlockingSync covers stream
// and device waits only), and dosd's waits last as long as the trainer's
// forward and backward, whose launch threads need those cores.
inline constexpr unsigned kHostWaitedEvent = cudaEventBlockingSync;

// Waits on the host for a trainer's interprocess event, whose flags are the
// trainer's: polls it, sleeping 20 us doubling to 200 us between polls.
// cudaEventSynchronize would spin on a core when the trainer made it without
// cudaEventBlockingSync, and a stream of dosd's made to wait for it (with a
// blocking event recorded behind) holds up every device-wide wait of dosd's,
// the cudaDeviceSynchronize that ends another session's step included, until
// the trainer's backward ends (GpuSharedTest). The last poll comes at most
// 200 us after the event.
inline absl::Status PollTrainerEvent(cudaEvent_t ev) {
  absl::Duration nap = absl::Microseconds(20);
  for (;;) {
    const cudaError_t err = cudaEventQuery(ev);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) return DOS_CUDA_STATUS(err);
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Microseconds(200));
  }
}

inline absl::Status NewEvents(cudaEvent_t* evs, int n) {
  for (int i = 0; i < n; ++i) {
    DOS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&evs[i], kHostWaitedEvent));
  }
  return absl::OkStatus();
}

inline void DestroyEvents(std::span<cudaEvent_t> evs) {
  for (cudaEvent_t& ev : evs) {
    if (ev != nullptr) cudaEventDestroy(ev);
    ev = nullptr;
  }
}

// Per-shard resources: the page-locked registrations of its host state and
// the resident GPU copies of its first subgroups.
class GpuEngine::Shard final : public ShardAttachment {
 public:
  Shard(int device, std::atomic<uint64_t>* resident_bytes)
      : device_(device), resident_bytes_(resident_bytes) {}
  ~Shard() override;
  void FreeResident(size_t i);

  std::vector<void*> registered;
  std::vector<float*> resident;        // per subgroup; null when streamed
  std::vector<uint64_t> resident_size;
  uint32_t resident_count = 0;         // resident are subgroups [0, resident_count)
  // Timing between steps (GpuEngine::MeasureWindow): recorded when the last
  // step ended and when the last delayed update ended (each valid once
  // recorded).
  cudaEvent_t last_end = nullptr, delayed_end = nullptr;
  bool last_end_valid = false, delayed_end_valid = false;
  // Per subgroup: its delayed copies are in (GpuEngine::CaptureLoop; waited
  // on by the step's "done" and by the delayed update, which the session
  // joins before the next step records them again).
  std::vector<cudaEvent_t> delayed_copied;

 private:
  const int device_;
  std::atomic<uint64_t>* resident_bytes_;
};

struct GpuEngine::StepRun {
  ShardState* shard = nullptr;
  std::span<const TensorBinding> bindings;
  std::span<const cpu::AdamScalars> scalars;
  Shard* gs = nullptr;
  const StepPlan* plan = nullptr;
  SubgroupQueue* queue = nullptr;
  double gpu_loop_us = 0;
  uint64_t streamed_params = 0;
  cudaEvent_t start = nullptr;
  absl::Time t0;
  // Plans that wait for each subgroup's gradients (plan->wait_ready): time
  // each loop spent waiting for them, not counted as the update's.
  double gpu_wait_us = 0, cpu_wait_us = 0;
  // Per staging slot, the subgroup whose state Prefetch already copied
  // there for this step (-1: none).
  std::vector<int64_t> prefetched;
  // Written by the GPU loop only.
  std::vector<TimelineEntry> gpu_entries;
  uint64_t gpu_params = 0, gpu_h2d = 0, gpu_d2h = 0, prefetched_bytes = 0,
           prefetched_params = 0;
  double h2d_us = 0, d2h_us = 0, kernel_us = 0;
  // Written by the CPU loop only.
  std::vector<TimelineEntry> cpu_entries;
  uint64_t cpu_params = 0, cpu_h2d = 0, cpu_d2h = 0;
  double cpu_kernel_us = 0, cpu_loop_us = 0;
  // Progress: one DoneCall per subgroup or run of subgroups first..last,
  // passed to cudaLaunchHostFunc (so its address must stay put: deques, one
  // per loop thread).
  const StepSync* sync = nullptr;
  struct DoneCall {
    const StepSync* sync;
    uint32_t first, last;
  };
  std::deque<DoneCall> gpu_done_calls, cpu_done_calls;
  // A delayed update on the GPU (GpuEngine::UpdateDelayedOnGpu): the
  // gradients and new weights are the delayed buffers', not the trainer's.
  const DelayedHost* delayed_io = nullptr;
  // DeviceAdamSpan::max_blocks of its kernels (GpuEngineOptions::delayed_kernel_blocks).
  uint32_t delayed_kernel_blocks = 0;
  // Recorded on the compute stream when the step starts there, after the
  // trainer's event (the trainer's gradients are final).
  cudaEvent_t ready = nullptr;
};

// Plans that wait for each subgroup's gradients: waits (on the host) until
// subgroup `sg`'s are final, adding the time to `*wait_us`; OK at once for
// other plans.
inline absl::Status WaitReady(const GpuEngine::StepRun& run, uint32_t sg, double* wait_us) {
  if (!run.plan->wait_ready) return absl::OkStatus();
  const absl::Time t0 = absl::Now();
  absl::Status st = run.sync->wait_ready(sg);
  *wait_us += absl::ToDoubleMicroseconds(absl::Now() - t0);
  return st;
}

// Enqueues "subgroups first..last are done" (StepSync::subgroup_done for
// each) on `stream` after the work queued there. A host function holds its
// stream until CUDA's callback thread ran it (~0.1 ms on nvidia-h200): runs
// of short kernels share one.
absl::Status EnqueueDone(GpuEngine::StepRun& run, std::deque<GpuEngine::StepRun::DoneCall>* calls,
                         uint32_t first, uint32_t last, cudaStream_t stream);
inline absl::Status EnqueueDone(GpuEngine::StepRun& run,
                                std::deque<GpuEngine::StepRun::DoneCall>* calls, uint32_t sg,
                                cudaStream_t stream) {
  return EnqueueDone(run, calls, sg, sg, stream);
}

}  // namespace dos::gpu
