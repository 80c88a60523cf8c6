#include "daemon/gpu/gpu_engine.h"

#include <cuda_runtime.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/gpu/cuda_check.h"
#include "daemon/gpu/cuda_ipc_transport.h"
#include "daemon/gpu/finite_scan.h"
#include "daemon/gpu/gpu_step.h"
#include "daemon/sched/device_selection.h"
#include "dos/wire/status_macros.h"

namespace dos::gpu {

GpuEngine::GpuEngine(const GpuEngineOptions& options, cpu::CpuUpdater* cpu,
                     cpu::CpuUpdater* delayed_cpu)
    : options_(options), cpu_(cpu), delayed_cpu_(delayed_cpu != nullptr ? delayed_cpu : cpu) {}

int GpuEngine::VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<GpuEngine>> GpuEngine::Create(const GpuEngineOptions& options,
                                                             cpu::CpuUpdater* cpu,
                                                             cpu::CpuUpdater* delayed_cpu) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device (", err == cudaSuccess ? "none found" : cudaGetErrorString(err), ")"));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu_devices names device ", options.device,
                                                   " but ", count, " CUDA device(s) are visible"));
  }
  if (options.staging_slots < 1) {
    return absl::InvalidArgumentError("--gpu_staging_slots must be >= 1");
  }
  std::unique_ptr<GpuEngine> e(new GpuEngine(options, cpu, delayed_cpu));
  DOS_RETURN_IF_ERROR(e->Init());
  return e;
}

absl::Status GpuEngine::Init() {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  // Host threads that wait for a stream or the device sleep instead of
  // spinning: the CPU pool and the trainers' launch threads need the cores.
  // (Events the host waits for block by their own flag: kHostWaitedEvent.)
  cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
  cudaGetLastError();
  unsigned flags = 0;
  const bool blocking = cudaGetDeviceFlags(&flags) == cudaSuccess &&
                        (flags & cudaDeviceScheduleMask) == cudaDeviceScheduleBlockingSync;
  cudaGetLastError();
  cudaDeviceProp prop;
  DOS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device));
  uuid_ = FormatDeviceUuid(absl::string_view(prop.uuid.bytes, sizeof prop.uuid.bytes));
  name_ = prop.name;
  // Kernel priorities (they order kernels only, not copy-engine work): the
  // resident subgroups' kernels, tens of milliseconds of them queued at a
  // step's start, go last; the streamed subgroups' kernels, whose slots and
  // D2H copies wait for them, and the CPU path's copy kernels, which the CPU
  // waits for, go first (timeline on nvidia-h200: one stream made the first
  // streamed kernel wait 26 ms behind 39 resident ones).
  int low = 0, high = 0;
  DOS_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&low, &high));
  for (cudaStream_t* s : {&h2d_, &d2h_, &resident_}) {
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, low));
  }
  for (cudaStream_t* s : {&compute_, &cpu_d2h_, &cpu_h2d_, &copy_d2h_, &copy_h2d_}) {
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, high));
  }
  DOS_CUDA_RETURN_IF_ERROR(cudaMalloc(&flag_dev_, sizeof(int)));
  DOS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&flag_host_, sizeof(int), cudaHostAllocDefault));
  worker_ = std::make_unique<GpuWorker>(absl::StrCat("dos-gpu-", options_.device));
  DOS_LOG_INFO("gpu.engine", "device", options_.device, "name", name_, "uuid", uuid_,
               "staging_slots", options_.staging_slots, "cpu_grad_fp32", options_.cpu_grad_fp32,
               "cpu_path_copy", options_.cpu_copy_kernel ? "kernel" : "dma", "stream_waits",
               blocking ? "sleep" : "spin");
  return absl::OkStatus();
}

GpuEngine::~GpuEngine() {
  worker_.reset();  // joins the worker before the streams go
  if (cudaSetDevice(options_.device) != cudaSuccess) return;
  for (float* p : slots_) cudaFree(p);
  for (float* p : cast_dev_) cudaFree(p);
  for (char* p : grad_host_) cudaFreeHost(p);
  for (char* p : weight_host_) cudaFreeHost(p);
  if (flag_dev_ != nullptr) cudaFree(flag_dev_);
  if (flag_host_ != nullptr) cudaFreeHost(flag_host_);
  for (cudaStream_t s :
       {h2d_, compute_, d2h_, resident_, cpu_d2h_, cpu_h2d_, copy_d2h_, copy_h2d_}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

std::string GpuEngine::name() const { return absl::StrCat("cuda:", options_.device); }

std::unique_ptr<Transport> GpuEngine::NewTransport() {
  return std::make_unique<CudaIpcTransport>(options_.device, uuid_);
}

absl::Status GpuEngine::CopyToHost(void* dst, const void* src, uint64_t bytes) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status GpuEngine::CopyToTrainer(void* dst, const void* src, uint64_t bytes) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuEngine::AllFinite(const ShardState& shard,
                                          std::span<const TensorBinding> bindings) {
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag_dev_, 0, sizeof(int), compute_));
  std::vector<ScanTensor> tensors;
  tensors.reserve(shard.tensors().size());
  for (size_t t = 0; t < shard.tensors().size(); ++t) {
    const TensorDesc& info = shard.tensors()[t];
    tensors.push_back({bindings[t].grad, info.grad_dtype, info.numel});
  }
  DOS_RETURN_IF_ERROR(LaunchNonFiniteScan(tensors.data(), tensors.size(), flag_dev_, compute_));
  DOS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(flag_host_, flag_dev_, sizeof(int), cudaMemcpyDeviceToHost, compute_));
  DOS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return *flag_host_ == 0;
}

absl::Status GpuEngine::EnsureBuffers(uint64_t max_numel) {
  if (max_numel <= buffer_numel_) return absl::OkStatus();
  for (float* p : slots_) DOS_CUDA_RETURN_IF_ERROR(cudaFree(p));
  for (float* p : cast_dev_) DOS_CUDA_RETURN_IF_ERROR(cudaFree(p));
  for (char* p : grad_host_) DOS_CUDA_RETURN_IF_ERROR(cudaFreeHost(p));
  for (char* p : weight_host_) DOS_CUDA_RETURN_IF_ERROR(cudaFreeHost(p));
  slots_.clear();
  prefetch_.clear();
  cast_dev_.clear();
  grad_host_.clear();
  weight_host_.clear();
  buffer_numel_ = 0;
  for (int i = 0; i < options_.staging_slots; ++i) {
    float* p = nullptr;
    absl::Status st = DOS_CUDA_STATUS(cudaMalloc(&p, SlotBytes(max_numel)));
    if (!st.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "gpu: cannot allocate staging slot ", i, " of ", FormatBytes(SlotBytes(max_numel)),
          " on the GPU; lower --gpu_staging_slots or the subgroup size: ", st.message()));
    }
    slots_.push_back(p);
  }
  for (int i = 0; i < kCpuBuffers; ++i) {
    char* g = nullptr;
    char* w = nullptr;
    DOS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&g, max_numel * kHostElemBytes, cudaHostAllocDefault));
    grad_host_.push_back(g);
    DOS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&w, max_numel * kHostElemBytes, cudaHostAllocDefault));
    weight_host_.push_back(w);
    if (options_.cpu_grad_fp32 && !options_.cpu_copy_kernel) {  // a kernel casts into the host
      float* c = nullptr;
      DOS_CUDA_RETURN_IF_ERROR(cudaMalloc(&c, max_numel * sizeof(float)));
      cast_dev_.push_back(c);
    }
  }
  buffer_numel_ = max_numel;
  return absl::OkStatus();
}

absl::StatusOr<void*> GpuEngine::OpenTrainerEvent(const std::string& handle) {
  cudaIpcEventHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "register: cuda_ipc_event has ", handle.size(), " bytes; a cudaIpcEventHandle_t has ",
        sizeof(h), " (send the bytes of cudaIpcGetEventHandle, or nothing)"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  cudaEvent_t ev = nullptr;
  cudaError_t err = cudaIpcOpenEventHandle(&ev, h);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "register: cuda_ipc_event could not be opened on device ", options_.device, " (",
        cudaGetErrorName(err), ": ", cudaGetErrorString(err),
        "); create it with cudaEventInterprocess | cudaEventDisableTiming on the device of the "
        "tensors"));
  }
  return static_cast<void*>(ev);
}

void GpuEngine::CloseTrainerEvent(void* event) {
  if (event == nullptr) return;
  if (cudaSetDevice(options_.device) == cudaSuccess) {
    cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
}

absl::Status GpuEngine::WaitTrainerEvent(void* event) {
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const auto ev = static_cast<cudaEvent_t>(event);
  // The streams that read gradients or write weights: the Adam kernels
  // (streamed and resident) and the CPU path's copies. The state streams
  // (h2d_, d2h_) do not wait: state does not depend on the trainer, and the
  // CPU path's weight copies that go on h2d_ (--gpu_cpu_path_copy=dma) are
  // issued after the host saw that path's gradient copies, which waited,
  // complete.
  for (cudaStream_t s : {compute_, resident_, cpu_d2h_, cpu_h2d_}) {
    if (s != nullptr) DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, ev, 0));
  }
  return absl::OkStatus();
}

absl::Status GpuEngine::SyncTrainerEvent(void* event) {
  // No step_mu_: the wait uses none of the engine's streams or buffers, and
  // it lasts as long as the trainer's backward.
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  return PollTrainerEvent(static_cast<cudaEvent_t>(event));
}

absl::Status GpuEngine::Prefetch(const StepPlan& plan, ShardState& shard) {
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  prefetch_.assign(slots_.size(), {});
  if (!options_.prefetch || shard.attachment() == nullptr || plan.num_subgroups != shard.subgroups().size() ||
      shard.tensors().empty()) {
    return absl::OkStatus();  // Execute reports these
  }
  // The GPU side claims its own subgroups first, then shared ones from the
  // front (SubgroupQueue): those are the ones it will most likely take first.
  std::vector<uint32_t> first;
  for (const std::vector<uint32_t>* list : {&plan.gpu_only, &plan.shared}) {
    for (uint32_t sg : *list) {
      if (first.size() == static_cast<size_t>(options_.staging_slots)) break;
      first.push_back(sg);
    }
  }
  if (first.empty()) return absl::OkStatus();
  DOS_RETURN_IF_ERROR(EnsureBuffers(plan.max_numel));
  prefetch_.assign(slots_.size(), {});
  const int64_t step = shard.tensors()[0].step;
  for (size_t i = 0; i < first.size() && i < slots_.size(); ++i) {
    const Subgroup& g = shard.subgroups()[first[i]];
    DOS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slots_[i], g.master, StateBytes(g), cudaMemcpyHostToDevice, h2d_));
    prefetch_[i] = SlotPrefetch{.shard = &shard, .subgroup = first[i], .step = step};
  }
  return absl::OkStatus();
}

absl::Status GpuEngine::Execute(const StepPlan& plan, ShardState& shard,
                                std::span<const TensorBinding> bindings,
                                std::span<const cpu::AdamScalars> scalars, const StepSync& sync,
                                StepMeasurements* measured) {
  // A checkpoint in flight: what this step may write on the host is copied
  // (or waited for) before step_mu_, so that a step waiting for a spent
  // staging pool holds up no other session on this GPU.
  shard.BeforeWritesFrom(plan.resident);
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::InternalError("gpu: shard was not attached to the GPU engine");
  const uint32_t n = static_cast<uint32_t>(shard.subgroups().size());
  if (plan.num_subgroups != n) {
    return absl::InternalError(absl::StrCat("gpu: the plan has ", plan.num_subgroups,
                                            " subgroups, the shard ", n));
  }
  if (plan.resident_order.size() != plan.resident) {
    return absl::InternalError(absl::StrCat("gpu: the plan orders ", plan.resident_order.size(),
                                            " of its ", plan.resident, " resident subgroups"));
  }
  DOS_RETURN_IF_ERROR(EnsureBuffers(plan.max_numel));
  DOS_ASSIGN_OR_RETURN(const uint32_t resident, ResizeResident(shard, plan.resident, true));
  if (resident != plan.resident) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gpu: the plan keeps ", plan.resident, " subgroups resident but device ", options_.device,
        " has memory for ", resident, "; lower the static fraction, the GPU memory budget or "
        "the session's GPU lease"));
  }
  // What Prefetch copied for this shard at this step is used; anything else
  // in the slots is overwritten.
  std::vector<int64_t> prefetched(slots_.size(), -1);
  for (size_t i = 0; i < prefetch_.size() && i < slots_.size(); ++i) {
    const SlotPrefetch& p = prefetch_[i];
    if (p.shard == &shard && !shard.tensors().empty() && p.step == shard.tensors()[0].step &&
        p.subgroup >= resident) {
      prefetched[i] = p.subgroup;
    }
  }
  prefetch_.assign(slots_.size(), {});
  // The lists are in the order the plan executes them (readiness order for
  // a plan that waits for each subgroup: StepPlanner).
  SubgroupQueue queue = plan.MakeQueue();
  StepRun run;
  run.prefetched = prefetched;
  run.shard = &shard;
  run.bindings = bindings;
  run.scalars = scalars;
  run.gs = gs;
  run.plan = &plan;
  run.queue = &queue;
  run.sync = &sync;
  DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&run.start));
  DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&run.ready));
  DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(run.ready, compute_));
  DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(run.start, h2d_));
  run.t0 = absl::Now();
  if (!plan.delayed.empty() && sync.delayed == nullptr) {
    return absl::InternalError("gpu: a delayed plan without the session's delayed buffers");
  }

  // The GPU path on the worker, the CPU path (a delayed step: its captures)
  // here, at once.
  absl::Status gpu_status;
  worker_->Start([&] {
    const absl::Time g0 = absl::Now();
    gpu_status = GpuLoop(run);
    run.gpu_loop_us = absl::ToDoubleMicroseconds(absl::Now() - g0);
  });
  absl::Status cpu_status = plan.delayed.empty() ? CpuLoop(run) : CaptureLoop(run);
  worker_->Wait();
  absl::Status synced = DOS_CUDA_STATUS(cudaDeviceSynchronize());
  const double wall_us = absl::ToDoubleMicroseconds(absl::Now() - run.t0);
  if (synced.ok()) MeasureWindow(run, measured);
  cudaEventDestroy(run.start);
  cudaEventDestroy(run.ready);
  DOS_RETURN_IF_ERROR(gpu_status);
  DOS_RETURN_IF_ERROR(cpu_status);
  DOS_RETURN_IF_ERROR(synced);
  if (run.cpu_entries.size() + run.gpu_entries.size() != n) {
    return absl::InternalError(absl::StrCat("gpu: step updated ",
                                            run.cpu_entries.size() + run.gpu_entries.size(),
                                            " of ", n, " subgroups"));
  }
  Measure(run, wall_us, measured);
  return absl::OkStatus();
}

void GpuEngine::Measure(StepRun& run, double wall_us, StepMeasurements* m) {
  m->cpu_params = run.cpu_params;
  m->gpu_params = run.gpu_params;
  m->streamed_params = run.streamed_params;
  m->gpu_h2d_bytes = run.gpu_h2d;
  m->prefetched_bytes = run.prefetched_bytes;
  m->prefetched_params = run.prefetched_params;
  m->gpu_d2h_bytes = run.gpu_d2h;
  m->cpu_h2d_bytes = run.cpu_h2d;
  m->cpu_d2h_bytes = run.cpu_d2h;
  m->cpu_kernel_us = run.cpu_kernel_us;
  m->gpu_kernel_us = run.kernel_us;
  m->h2d_us = run.h2d_us;
  m->d2h_us = run.d2h_us;
  // Early steps: what the planner learns from must not count the wait for
  // backward (the wall time less the longer of the two loops' waits: an
  // upper bound on the rate, close when the host paths bind).
  m->cpu_loop_us = run.cpu_loop_us - run.cpu_wait_us;
  m->gpu_loop_us = run.gpu_loop_us - run.gpu_wait_us;
  m->wall_us = wall_us - std::max(run.cpu_wait_us, run.gpu_wait_us);
  m->gpu_memory_bytes = slots_.size() * SlotBytes(buffer_numel_) +
                        cast_dev_.size() * buffer_numel_ * sizeof(float) + resident_bytes_.load();
  m->entries = std::move(run.gpu_entries);
  m->entries.insert(m->entries.end(), run.cpu_entries.begin(), run.cpu_entries.end());
}

}  // namespace dos::gpu
