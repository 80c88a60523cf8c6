// GpuEngine's delayed host path (daemon/sched/delayed_host.h): a delayed
// step's captures on the CPU path's streams, the installs of pending weights
// outside a step, the CPU update after the result, and the window between
// steps measured on the GPU.
//
// Captures of an early step during backward (CaptureDelayed) are the same
// copies per subgroup, done before the verdict; the step's capture then
// only marks those subgroups done.
// A captured subgroup's copies: its pending weights H2D (when it has any)
// and its gradients D2H, on the CPU path's two streams (both wait for the
// trainer's event: WaitTrainerEvent), then "done" on the H2D stream once the
// D2H stream's copy is in too: the trainer's next backward may overwrite the
// gradients and its next forward reads the weights. By DMA always: a delayed
// step's copies come in one burst after backward, with the copy engines
// otherwise idle (on nvidia-h200 at 6B with 1.6B parameters delayed, a step
// with copy kernels took about 0.3 s after backward where the model's DMA
// rates say 65 ms for these copies).
#include <cuda_runtime.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/cpu/delayed_update.h"
#include "daemon/cpu/subgroup_spans.h"
#include "daemon/gpu/gpu_step.h"

namespace dos::gpu {
namespace {

absl::Status CopyOn(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind,
                    cudaStream_t stream) {
  return DOS_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, kind, stream));
}

// The pending weights of subgroup `sg` into the trainer's parameters.
absl::Status QueueInstall(const ShardState& shard,
                          std::span<const TensorBinding> bindings, const DelayedHost& delayed,
                          uint32_t sg, cudaStream_t stream, uint64_t* bytes) {
  for (const SubgroupSegment& seg : shard.subgroups()[sg].segments) {
    const TensorDesc& t = shard.tensors()[seg.tensor];
    const uint64_t n = seg.count * DTypeSize(t.param_dtype);
    DOS_RETURN_IF_ERROR(CopyOn(cpu::ElementAt(bindings[seg.tensor].param, t.param_dtype,
                                              seg.tensor_offset),
                               delayed.weight(sg, seg), n, cudaMemcpyHostToDevice, stream));
    *bytes += n;
  }
  return absl::OkStatus();
}

// The gradients of subgroup `sg` into `delayed`'s buffers.
absl::Status QueueCapture(const ShardState& shard, std::span<const TensorBinding> bindings,
                          const DelayedHost& delayed, uint32_t sg, cudaStream_t stream,
                          uint64_t* bytes) {
  for (const SubgroupSegment& seg : shard.subgroups()[sg].segments) {
    const TensorDesc& t = shard.tensors()[seg.tensor];
    const uint64_t n = seg.count * DTypeSize(t.grad_dtype);
    DOS_RETURN_IF_ERROR(
        CopyOn(delayed.grad(sg, seg),
               cpu::ElementAt(bindings[seg.tensor].grad, t.grad_dtype, seg.tensor_offset), n,
               cudaMemcpyDeviceToHost, stream));
    *bytes += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostBuffer> GpuEngine::AllocStaging(uint64_t bytes) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  char* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaHostAlloc of ", bytes, " bytes: ",
                                                     cudaGetErrorString(err)));
  }
  const int device = options_.device;
  return HostBuffer(p, [device](char* q) {
    if (cudaSetDevice(device) == cudaSuccess) cudaFreeHost(q);
  });
}

absl::Status GpuEngine::CopyDelayed(const ShardState& shard,
                                    std::span<const TensorBinding> bindings,
                                    const DelayedHost& delayed, std::span<const uint32_t> subgroups,
                                    bool capture) {
  // Not step_mu_ (copy_mu_): these copies touch no slot, state or stream of
  // a step, only the trainer's memory and `delayed`'s buffers.
  absl::MutexLock lock(&copy_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  uint64_t bytes = 0;
  for (uint32_t sg : subgroups) {
    if (!capture || delayed.installs(sg)) {
      DOS_RETURN_IF_ERROR(QueueInstall(shard, bindings, delayed, sg, copy_h2d_, &bytes));
    }
    if (capture) {
      DOS_RETURN_IF_ERROR(QueueCapture(shard, bindings, delayed, sg, copy_d2h_, &bytes));
    }
  }
  for (cudaStream_t s : {copy_h2d_, copy_d2h_}) {
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  }
  return absl::OkStatus();
}

absl::Status GpuEngine::InstallDelayed(const ShardState& shard,
                                       std::span<const TensorBinding> bindings,
                                       const DelayedHost& delayed,
                                       std::span<const uint32_t> subgroups) {
  return CopyDelayed(shard, bindings, delayed, subgroups, false);
}

absl::Status GpuEngine::CaptureDelayed(const ShardState& shard,
                                       std::span<const TensorBinding> bindings,
                                       const DelayedHost& delayed,
                                       std::span<const uint32_t> subgroups) {
  // Backward still runs on the trainer's stream: the ready words it wrote
  // after the gradients' kernels are what orders these copies after them.
  return CopyDelayed(shard, bindings, delayed, subgroups, true);
}

absl::Status GpuEngine::UpdateDelayedOnGpu(ShardState& shard, const DelayedHost& delayed) {
  std::vector<uint32_t> subgroups;
  uint64_t max_numel = 0;
  for (uint32_t sg : delayed.captured()) {
    if (!delayed.updates_on_gpu(sg)) continue;
    subgroups.push_back(sg);
    max_numel = std::max(max_numel, shard.subgroups()[sg].numel);
  }
  if (subgroups.empty()) return absl::OkStatus();
  shard.BeforeWrites(subgroups);  // no wait for a checkpoint's writer under step_mu_
  // The staging slots are the steps' too: held for the whole update (a step
  // of another session waits; this session's next step joins it first).
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_RETURN_IF_ERROR(EnsureBuffers(max_numel));
  // What Prefetch put in the slots is overwritten here.
  for (SlotPrefetch& p : prefetch_) p = SlotPrefetch{};
  StepPlan plan;  // no waits for gradients: all are in the buffers
  StepRun run;
  run.shard = &shard;
  run.scalars = delayed.scalars();
  run.gs = static_cast<Shard*>(shard.attachment());
  run.plan = &plan;
  run.delayed_io = &delayed;
  run.delayed_kernel_blocks = options_.delayed_kernel_blocks;
  const absl::Time start = absl::Now();
  DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&run.start));
  absl::Status status = DOS_CUDA_STATUS(cudaEventRecord(run.start, h2d_));
  if (status.ok()) status = StreamDelayed(run, subgroups);
  // The weights the kernels wrote over PCIe (or the slots' copies, staged)
  // are in host memory once their stream is done (StreamDelayed).
  absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(resident_));
  if (status.ok()) status = st;
  if (status.ok()) {
    for (uint32_t sg : subgroups) delayed.MarkUpdated(sg);  // a hand-off's next step may take them
  }
  cudaEventDestroy(run.start);
  // The GPU's share of the delayed update, for an operator comparing it
  // with the window (its copy engines' and kernels' busy time).
  DOS_LOG_DEBUG("delayed.gpu", "subgroups", subgroups.size(), "params", run.gpu_params,
                "kernel_blocks", run.delayed_kernel_blocks, "staged", options_.delayed_staged,
                "wall_us", absl::ToDoubleMicroseconds(absl::Now() - start), "h2d_us", run.h2d_us,
                "kernel_us", run.kernel_us, "d2h_us", run.d2h_us, "h2d_bytes", run.gpu_h2d,
                "d2h_bytes", run.gpu_d2h);
  return status;
}

absl::Status GpuEngine::UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                                      double* kernel_us) {
  // The subgroups the plan streams in the window go to the GPU on a thread
  // of their own, beside the CPU kernel's.
  absl::Status gpu_status;
  std::thread gpu;
  if (delayed.any_on_gpu()) {
    gpu = std::thread([&] { gpu_status = UpdateDelayedOnGpu(shard, delayed); });
  }
  // The CPU kernel holds no engine lock (another session's step may run on
  // the GPU meanwhile; the CPU updater is thread-safe).
  absl::Status cpu_status = cpu::UpdateDelayed(delayed_cpu_, shard, delayed, kernel_us);
  if (gpu.joinable()) gpu.join();
  DOS_RETURN_IF_ERROR(cpu_status);
  DOS_RETURN_IF_ERROR(gpu_status);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (gs->delayed_end == nullptr) {
    DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&gs->delayed_end));
  }
  // The resident stream is idle between steps: the event completes now.
  DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(gs->delayed_end, resident_));
  gs->delayed_end_valid = true;
  return absl::OkStatus();
}

absl::Status GpuEngine::CaptureLoop(StepRun& run) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DelayedHost& delayed = *run.sync->delayed;
  const absl::Time loop_start = absl::Now();
  // One event a subgroup, recorded after its gradients' copy (its "done"
  // waits for that), then after its install: its part of the delayed update
  // waits for both.
  std::vector<cudaEvent_t>& copied = run.gs->delayed_copied;
  while (copied.size() < run.shard->subgroups().size()) {
    cudaEvent_t ev = nullptr;
    DOS_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | kHostWaitedEvent));
    copied.push_back(ev);
  }
  absl::Status status;
  for (uint32_t sg : run.plan->delayed) {
    if (delayed.installs(sg)) {
      status = QueueInstall(*run.shard, run.bindings, delayed, sg, cpu_h2d_, &run.cpu_h2d);
      if (!status.ok()) break;
    }
    // Captured during backward already (an early step: EarlyCapture).
    if (!delayed.captured_early(sg)) {
      status = QueueCapture(*run.shard, run.bindings, delayed, sg, cpu_d2h_, &run.cpu_d2h);
      if (!status.ok()) break;
    }
    status = DOS_CUDA_STATUS(cudaEventRecord(copied[sg], cpu_d2h_));
    if (status.ok()) status = DOS_CUDA_STATUS(cudaStreamWaitEvent(cpu_h2d_, copied[sg], 0));
    if (status.ok()) status = EnqueueDone(run, &run.cpu_done_calls, sg, cpu_h2d_);
    // Recorded again behind the install too (the wait above took the first
    // record): the update writes the new weights where the install reads
    // the pending ones.
    if (status.ok()) status = DOS_CUDA_STATUS(cudaEventRecord(copied[sg], cpu_h2d_));
    if (!status.ok()) break;
    run.cpu_entries.push_back(TimelineEntry{.subgroup = sg, .path = 'd'});
  }
  // Every copy is queued: the update may start (its CPU is idle in a delayed
  // step), each subgroup once its gradients are in, beside the copies of the
  // rest and the GPU path (measured on nvidia-h200 at 6B, 1.9B parameters
  // delayed: the update waited 72 ms for the last copy when it started after
  // all of them).
  if (status.ok() && run.sync->delayed_captured) {
    delayed.await_capture = [events = &copied, device = options_.device](uint32_t sg) {
      DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      return DOS_CUDA_STATUS(cudaEventSynchronize((*events)[sg]));
    };
    run.sync->delayed_captured();
  }
  for (cudaStream_t s : {cpu_d2h_, cpu_h2d_}) {
    absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(s));
    if (status.ok()) status = st;
  }
  run.cpu_loop_us = absl::ToDoubleMicroseconds(absl::Now() - loop_start);
  return status;
}

void GpuEngine::MeasureWindow(StepRun& run, StepMeasurements* m) {
  Shard* gs = run.gs;
  float ms = 0;
  if (gs->last_end_valid && cudaEventElapsedTime(&ms, gs->last_end, run.ready) == cudaSuccess) {
    m->window_us = ms * 1e3;
  }
  if (gs->delayed_end_valid &&
      cudaEventElapsedTime(&ms, gs->delayed_end, run.ready) == cudaSuccess) {
    m->delayed_slack_us = ms * 1e3;
  }
  cudaGetLastError();  // an elapsed time the driver would not give is only a figure lost
  gs->delayed_end_valid = false;
  if (gs->last_end == nullptr && cudaEventCreate(&gs->last_end) != cudaSuccess) {
    cudaGetLastError();
    gs->last_end = nullptr;
    return;
  }
  gs->last_end_valid = cudaEventRecord(gs->last_end, compute_) == cudaSuccess;
}

}  // namespace dos::gpu
