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
#include "dos/wire/status_macros.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/gpu/cuda_check.h"
#include "daemon/gpu/cuda_ipc_transport.h"
#include "daemon/sched/subgroup_queue.h"

namespace dos::gpu {
namespace {

// Pinned gradient/weight buffers of the CPU path, used round robin. Four, not
// two: a finished subgroup's weights wait in the H2D queue behind the GPU
// path's state copies (tens of ms), and the CPU must not stall on reusing
// their buffer meanwhile (measured on nvidia-h200: with two, the CPU kernel
// sat idle for about a tenth of an `auto` step).
constexpr int kCpuBuffers = 4;
// Bytes per element reserved in the CPU path's pinned buffers: the widest
// dtype, so one layout (element offset * 4) serves every tensor of a subgroup.
constexpr uint64_t kHostElemBytes = 4;

uint64_t StateBytes(const Subgroup& g) { return g.numel * ShardState::kStateBytesPerParam; }

const char* At(const void* base, DType dtype, uint64_t elems) {
  return static_cast<const char*>(base) + elems * DTypeSize(dtype);
}

// Milliseconds from `start` to `ev` (both complete), in microseconds.
double EventUs(cudaEvent_t start, cudaEvent_t ev) {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, start, ev) != cudaSuccess) return 0;
  return ms * 1e3;
}

absl::Status NewEvents(cudaEvent_t* evs, int n) {
  for (int i = 0; i < n; ++i) DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&evs[i]));
  return absl::OkStatus();
}

}  // namespace

// Per-shard resources: the page-locked registrations of its host state and
// the resident GPU copies of its first subgroups.
class GpuEngine::Shard final : public ShardAttachment {
 public:
  Shard(int device, std::atomic<uint64_t>* resident_bytes)
      : device_(device), resident_bytes_(resident_bytes) {}
  ~Shard() override {
    if (cudaSetDevice(device_) != cudaSuccess) return;
    for (void* p : registered) {
      absl::Status st = DOS_CUDA_STATUS(cudaHostUnregister(p));
      if (!st.ok()) DOS_LOG_WARNING("gpu.unregister_failed", "error", st.message());
    }
    for (size_t i = 0; i < resident.size(); ++i) FreeResident(i);
  }
  void FreeResident(size_t i) {
    if (resident[i] == nullptr) return;
    absl::Status st = DOS_CUDA_STATUS(cudaFree(resident[i]));
    if (!st.ok()) DOS_LOG_WARNING("gpu.free_failed", "error", st.message());
    resident[i] = nullptr;
    resident_bytes_->fetch_sub(resident_size[i]);
  }

  std::vector<void*> registered;
  std::vector<float*> resident;        // per subgroup; null when streamed
  std::vector<uint64_t> resident_size;
  uint32_t resident_count = 0;         // resident are subgroups [0, resident_count)

 private:
  const int device_;
  std::atomic<uint64_t>* resident_bytes_;
};

// One timeline entry: which subgroup ran where and when (microseconds from
// the step's start). Path 'r' resident, 'g' streamed, 'c' CPU; `in` is the
// inbound copy (state H2D or gradients D2H), `out` the outbound one.
struct TimelineEntry {
  uint32_t subgroup = 0;
  char path = 'c';
  double in0 = 0, in1 = 0, k0 = 0, k1 = 0, out0 = 0, out1 = 0;
};

struct GpuEngine::StepRun {
  ShardState* shard = nullptr;
  std::span<const TensorBinding> bindings;
  std::span<const cpu::AdamScalars> scalars;
  Shard* gs = nullptr;
  SubgroupQueue* queue = nullptr;
  PerfInputs inputs;
  double cpu_rate = 0;  // CPU-path params/s as a whole (copies and waits included)
  double gpu_rate = 0;  // GPU-path (streamed) params/s as a whole; 0 until measured
  double gpu_loop_us = 0;
  uint64_t streamed_params = 0;
  cudaEvent_t start = nullptr;
  absl::Time t0;
  // Written by the GPU loop only.
  std::vector<TimelineEntry> gpu_entries;
  uint64_t gpu_params = 0, gpu_h2d = 0, gpu_d2h = 0;
  double h2d_us = 0, d2h_us = 0, kernel_us = 0;
  // Written by the CPU loop only.
  std::vector<TimelineEntry> cpu_entries;
  uint64_t cpu_params = 0, cpu_h2d = 0, cpu_d2h = 0;
  double cpu_kernel_us = 0, cpu_loop_us = 0;
  // Progress: one DoneCall per subgroup, passed to cudaLaunchHostFunc (so
  // its address must stay put: deques, one per loop thread).
  const StepSync* sync = nullptr;
  struct DoneCall {
    const StepSync* sync;
    uint32_t subgroup;
  };
  std::deque<DoneCall> gpu_done_calls, cpu_done_calls;
};

namespace {

void CUDART_CB SubgroupDoneCallback(void* arg) {
  const auto* call = static_cast<const GpuEngine::StepRun::DoneCall*>(arg);
  call->sync->subgroup_done(call->subgroup);
}

// Enqueues "subgroup `sg` is done" on `stream` after the work queued there.
absl::Status EnqueueDone(GpuEngine::StepRun& run, std::deque<GpuEngine::StepRun::DoneCall>* calls,
                         uint32_t sg, cudaStream_t stream) {
  if (run.sync == nullptr || !run.sync->subgroup_done) return absl::OkStatus();
  calls->push_back({run.sync, sg});
  DOS_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, SubgroupDoneCallback, &calls->back()));
  return absl::OkStatus();
}

}  // namespace

GpuEngine::GpuEngine(const GpuEngineOptions& options, cpu::CpuUpdater* cpu)
    : options_(options), cpu_(cpu), model_(options.model) {}

int GpuEngine::VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<GpuEngine>> GpuEngine::Create(const GpuEngineOptions& options,
                                                             cpu::CpuUpdater* cpu) {
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
  std::unique_ptr<GpuEngine> e(new GpuEngine(options, cpu));
  DOS_RETURN_IF_ERROR(e->Init());
  return e;
}

absl::Status GpuEngine::Init() {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  // Host threads that wait for the GPU sleep instead of spinning: the CPU
  // pool needs every core during the update phase. (Ignored if the context
  // already exists.)
  cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
  cudaGetLastError();
  cudaDeviceProp prop;
  DOS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device));
  uuid_ = FormatDeviceUuid(absl::string_view(prop.uuid.bytes, sizeof prop.uuid.bytes));
  name_ = prop.name;
  for (cudaStream_t* s : {&h2d_, &compute_, &d2h_, &cpu_d2h_, &cpu_h2d_}) {
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  }
  DOS_CUDA_RETURN_IF_ERROR(cudaMalloc(&flag_dev_, sizeof(int)));
  DOS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&flag_host_, sizeof(int), cudaHostAllocDefault));
  DOS_LOG_INFO("gpu.engine", "device", options_.device, "name", name_, "uuid", uuid_,
               "staging_slots", options_.staging_slots, "resident_budget",
               options_.resident_budget_bytes, "cpu_grad_fp32", options_.cpu_grad_fp32);
  return absl::OkStatus();
}

GpuEngine::~GpuEngine() {
  if (cudaSetDevice(options_.device) != cudaSuccess) return;
  for (float* p : slots_) cudaFree(p);
  for (float* p : cast_dev_) cudaFree(p);
  for (char* p : grad_host_) cudaFreeHost(p);
  for (char* p : weight_host_) cudaFreeHost(p);
  if (flag_dev_ != nullptr) cudaFree(flag_dev_);
  if (flag_host_ != nullptr) cudaFreeHost(flag_host_);
  for (cudaStream_t s : {h2d_, compute_, d2h_, cpu_d2h_, cpu_h2d_}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

std::unique_ptr<Transport> GpuEngine::NewTransport() {
  return std::make_unique<CudaIpcTransport>(options_.device, uuid_);
}

absl::Status GpuEngine::CopyToHost(void* dst, const void* src, uint64_t bytes) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status GpuEngine::CopyToDevice(void* dst, const void* src, uint64_t bytes) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

PerfInputs GpuEngine::model_inputs() const {
  absl::MutexLock lock(&step_mu_);
  return model_.inputs();
}

absl::Status GpuEngine::AttachShard(ShardState& shard, RegisterProgress* progress) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  auto gs = std::make_unique<Shard>(options_.device, &resident_bytes_);
  const absl::Time start = absl::Now();
  const HostArena& arena = shard.arena();
  // What to page-lock: each subgroup's slot, or (pin_whole) the one mapping.
  struct Range {
    void* p;
    uint64_t bytes;
  };
  std::vector<Range> ranges;
  if (options_.pin_whole) {
    // From the first slot to the end of the last (the alignment gaps between
    // slots, under 2 MiB each, are pinned too).
    const size_t last = arena.num_slots() - 1;
    char* begin = static_cast<char*>(arena.slot(0));
    ranges.push_back({begin, static_cast<uint64_t>(static_cast<char*>(arena.slot(last)) +
                                                   arena.slot_bytes(last) - begin)});
  } else {
    for (size_t i = 0; i < arena.num_slots(); ++i) {
      ranges.push_back({arena.slot(i), arena.slot_bytes(i)});
    }
  }
  uint64_t total = 0;
  for (const Range& r : ranges) total += r.bytes;
  if (progress != nullptr) progress->BeginPhase(kRegisterPinning, total);
  // Measured on nvidia-h200 (bench/register, 72 GB in 2 MiB pages, already
  // touched): 1.7-1.8 s whichever way: one call for the whole shard, one per
  // subgroup from 16 threads, or one after another (the driver serialises the
  // work); with 4 KiB pages 3.3 s. Per subgroup is the default because the
  // progress then moves. Every range is attempted; the first error is reported.
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, std::min<int>(options_.pin_threads > 0 ? options_.pin_threads
                                                                         : std::min(hw, 16),
                                                static_cast<int>(ranges.size())));
  std::vector<absl::Status> results(ranges.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    if (absl::Status st = DOS_CUDA_STATUS(cudaSetDevice(options_.device)); !st.ok()) {
      for (size_t i = next.fetch_add(ranges.size()); i < ranges.size(); ++i) results[i] = st;
      return;
    }
    for (size_t i = next.fetch_add(1); i < ranges.size(); i = next.fetch_add(1)) {
      results[i] = DOS_CUDA_STATUS(
          cudaHostRegister(ranges[i].p, ranges[i].bytes, cudaHostRegisterDefault));
      if (results[i].ok() && progress != nullptr) progress->Add(ranges[i].bytes);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      pthread_setname_np(pthread_self(), absl::StrCat("dos-pin-", t).c_str());
      worker();
    });
  }
  worker();
  for (std::thread& th : pool) th.join();
  uint64_t pinned = 0;
  absl::Status first_error;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (results[i].ok()) {
      gs->registered.push_back(ranges[i].p);  // unregistered with the shard
      pinned += ranges[i].bytes;
    } else if (first_error.ok()) {
      first_error = results[i];
    }
  }
  if (!first_error.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: cannot page-lock ", FormatBytes(total), " of optimizer state for the GPU "
        "path (", FormatBytes(pinned), " succeeded; check `ulimit -l` / LimitMEMLOCK): ",
        first_error.message()));
  }
  gs->resident.assign(shard.subgroups().size(), nullptr);
  gs->resident_size.assign(shard.subgroups().size(), 0);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  DOS_LOG_INFO("gpu.pin", "bytes", total, "subgroups", shard.subgroups().size(), "ranges",
               ranges.size(), "threads", threads, "huge_pages", arena.huge_pages(), "seconds",
               seconds, "gb_per_s", seconds > 0 ? total / seconds * 1e-9 : 0.0);
  shard.set_attachment(std::move(gs));
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuEngine::AllFinite(const ShardState& shard,
                                          std::span<const TensorBinding> bindings) {
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  DOS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag_dev_, 0, sizeof(int), compute_));
  for (size_t t = 0; t < shard.tensors().size(); ++t) {
    const TensorInfo& info = shard.tensors()[t];
    DOS_RETURN_IF_ERROR(
        LaunchNonFiniteScan(bindings[t].grad, info.grad_dtype, info.numel, flag_dev_, compute_));
  }
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
  cast_dev_.clear();
  grad_host_.clear();
  weight_host_.clear();
  buffer_numel_ = 0;
  for (int i = 0; i < options_.staging_slots; ++i) {
    float* p = nullptr;
    absl::Status st = DOS_CUDA_STATUS(cudaMalloc(&p, max_numel * ShardState::kStateBytesPerParam));
    if (!st.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "gpu: cannot allocate staging slot ", i, " of ",
          FormatBytes(max_numel * ShardState::kStateBytesPerParam),
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
    if (options_.cpu_grad_fp32) {
      float* c = nullptr;
      DOS_CUDA_RETURN_IF_ERROR(cudaMalloc(&c, max_numel * sizeof(float)));
      cast_dev_.push_back(c);
    }
  }
  buffer_numel_ = max_numel;
  return absl::OkStatus();
}

absl::Status GpuEngine::SetResident(ShardState& shard, uint32_t count) {
  auto* gs = static_cast<Shard*>(shard.attachment());
  std::span<Subgroup> sgs = shard.subgroups();
  count = std::min<uint32_t>(count, sgs.size());
  for (size_t i = count; i < sgs.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    shard.BeforeWrite(static_cast<uint32_t>(i));  // checkpoint copy-on-write
    DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(sgs[i].master, gs->resident[i], StateBytes(sgs[i]),
                                        cudaMemcpyDeviceToHost));
    gs->FreeResident(i);
  }
  for (size_t i = 0; i < count; ++i) {
    if (gs->resident[i] != nullptr) continue;
    float* p = nullptr;
    absl::Status st = DOS_CUDA_STATUS(cudaMalloc(&p, StateBytes(sgs[i])));
    if (!st.ok()) {
      gs->resident_count = static_cast<uint32_t>(i);
      return absl::ResourceExhaustedError(absl::StrCat(
          "gpu: cannot keep subgroup ", i, " (", FormatBytes(StateBytes(sgs[i])),
          ") resident on the GPU; lower the static fraction or the GPU memory budget: ",
          st.message()));
    }
    gs->resident[i] = p;
    gs->resident_size[i] = StateBytes(sgs[i]);
    resident_bytes_.fetch_add(StateBytes(sgs[i]));
    DOS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(p, sgs[i].master, StateBytes(sgs[i]), cudaMemcpyHostToDevice));
  }
  gs->resident_count = count;
  return absl::OkStatus();
}

absl::Status GpuEngine::SyncResidentToHost(ShardState& shard) {
  absl::MutexLock lock(&step_mu_);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::OkStatus();
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  for (size_t i = 0; i < gs->resident.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(shard.subgroups()[i].master, gs->resident[i],
                                        gs->resident_size[i], cudaMemcpyDeviceToHost));
  }
  return absl::OkStatus();
}

void GpuEngine::DropResident(ShardState& shard) {
  absl::MutexLock lock(&step_mu_);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return;
  if (cudaSetDevice(options_.device) != cudaSuccess) return;
  for (size_t i = 0; i < gs->resident.size(); ++i) gs->FreeResident(i);
  gs->resident_count = 0;
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
  auto ev = static_cast<cudaEvent_t>(event);
  for (cudaStream_t s : {h2d_, compute_, d2h_, cpu_d2h_, cpu_h2d_}) {
    if (s != nullptr) DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, ev, 0));
  }
  return absl::OkStatus();
}

absl::Status GpuEngine::GpuLoop(StepRun& run) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  ShardState& shard = *run.shard;
  std::span<Subgroup> sgs = shard.subgroups();
  std::span<const TensorInfo> tensors = shard.tensors();
  auto launch = [&](const Subgroup& g, float* state) -> absl::Status {
    for (const SubgroupSegment& seg : g.segments) {
      const TensorInfo& t = tensors[seg.tensor];
      const TensorBinding& b = run.bindings[seg.tensor];
      DeviceAdamSpan span{
          .grad = At(b.grad, t.grad_dtype, seg.tensor_offset),
          .grad_dtype = t.grad_dtype,
          .master = state + seg.subgroup_offset,
          .exp_avg = state + g.numel + seg.subgroup_offset,
          .exp_avg_sq = state + 2 * g.numel + seg.subgroup_offset,
          .param_out = const_cast<char*>(At(b.param, t.param_dtype, seg.tensor_offset)),
          .param_dtype = t.param_dtype,
          .n = seg.count};
      DOS_RETURN_IF_ERROR(LaunchAdam(run.scalars[seg.tensor], span, compute_));
    }
    return absl::OkStatus();
  };

  // Resident subgroups: kernels only, first, on the compute stream.
  std::vector<cudaEvent_t> res_events(2 * run.gs->resident_count);
  DOS_RETURN_IF_ERROR(NewEvents(res_events.data(), static_cast<int>(res_events.size())));
  for (uint32_t i = 0; i < run.gs->resident_count; ++i) {
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_events[2 * i], compute_));
    DOS_RETURN_IF_ERROR(launch(sgs[i], run.gs->resident[i]));
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_events[2 * i + 1], compute_));
    DOS_RETURN_IF_ERROR(EnqueueDone(run, &run.gpu_done_calls, i, compute_));
    run.gpu_params += sgs[i].numel;
  }

  struct Slot {
    uint32_t subgroup = 0;
    cudaEvent_t ev[6] = {};  // h2d start/end, kernel start/end, d2h start/end
  };
  const int num_slots = options_.staging_slots;
  std::vector<Slot> slots(num_slots);
  absl::Status status;
  for (Slot& s : slots) {
    status = NewEvents(s.ev, 6);
    if (!status.ok()) break;
  }
  std::deque<int> busy;  // slots in flight, oldest first
  std::vector<int> free_slots;
  for (int i = num_slots - 1; i >= 0; --i) free_slots.push_back(i);

  auto retire_oldest = [&]() -> absl::Status {
    Slot& s = slots[busy.front()];
    DOS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.ev[5]));
    TimelineEntry e;
    e.subgroup = s.subgroup;
    e.path = 'g';
    e.in0 = EventUs(run.start, s.ev[0]);
    e.in1 = EventUs(run.start, s.ev[1]);
    e.k0 = EventUs(run.start, s.ev[2]);
    e.k1 = EventUs(run.start, s.ev[3]);
    e.out0 = EventUs(run.start, s.ev[4]);
    e.out1 = EventUs(run.start, s.ev[5]);
    run.h2d_us += e.in1 - e.in0;
    run.kernel_us += e.k1 - e.k0;
    run.d2h_us += e.out1 - e.out0;
    run.gpu_entries.push_back(e);
    free_slots.push_back(busy.front());
    busy.pop_front();
    return absl::OkStatus();
  };

  // Would the GPU finish one more subgroup sooner than the CPU would, given
  // what each still has to do? (The dynamic-claiming rule of `auto`.)
  const PerfInputs& in = run.inputs;
  auto take = [&](uint64_t n, uint64_t shared_left) {
    const double bytes = 12.0 * static_cast<double>(n);
    // The GPU path's measured throughput as a whole (both copy directions
    // sharing PCIe and host memory with the CPU path) sets its period; the
    // copy-engine rates alone overstate it.
    const double period = run.gpu_rate > 0
                              ? static_cast<double>(n) / run.gpu_rate
                              : bytes / std::min(in.h2d_bytes_per_s, in.d2h_bytes_per_s);
    const double latency =
        bytes / in.h2d_bytes_per_s + n / in.gpu_params_per_s + bytes / in.d2h_bytes_per_s;
    const double inflight = static_cast<double>(busy.size());
    const double gpu_without = inflight * period;
    const double gpu_with = std::max(latency, (inflight + 1) * period);
    const double cpu_with_gpu = static_cast<double>(shared_left - n) / run.cpu_rate;
    const double cpu_alone = static_cast<double>(shared_left) / run.cpu_rate;
    return std::max(gpu_with, cpu_with_gpu) <= std::max(gpu_without, cpu_alone);
  };

  while (status.ok()) {
    if (free_slots.empty()) {
      status = retire_oldest();
      continue;
    }
    std::optional<uint32_t> claim = run.queue->ClaimGpu(take);
    if (!claim) {
      if (busy.empty() || !run.queue->GpuMayHaveWork()) break;
      status = retire_oldest();  // a freed slot may change the answer
      continue;
    }
    const int si = free_slots.back();
    free_slots.pop_back();
    Slot& s = slots[si];
    s.subgroup = *claim;
    const Subgroup& g = sgs[*claim];
    shard.BeforeWrite(*claim);  // checkpoint copy-on-write: the D2H below writes it back
    float* state = slots_[si];
    const uint64_t bytes = StateBytes(g);
    status = [&]() -> absl::Status {
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[0], h2d_));
      DOS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(state, g.master, bytes, cudaMemcpyHostToDevice, h2d_));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[1], h2d_));
      DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, s.ev[1], 0));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[2], compute_));
      DOS_RETURN_IF_ERROR(launch(g, state));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[3], compute_));
      // The trainer's weights are final once the kernel ran (the state's
      // way back to the host does not concern it).
      DOS_RETURN_IF_ERROR(EnqueueDone(run, &run.gpu_done_calls, s.subgroup, compute_));
      DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h_, s.ev[3], 0));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[4], d2h_));
      DOS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(g.master, state, bytes, cudaMemcpyDeviceToHost, d2h_));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[5], d2h_));
      return absl::OkStatus();
    }();
    busy.push_back(si);
    run.gpu_params += g.numel;
    run.streamed_params += g.numel;
    run.gpu_h2d += bytes;
    run.gpu_d2h += bytes;
  }
  while (!busy.empty()) {
    absl::Status st = retire_oldest();
    if (!st.ok()) {
      if (status.ok()) status = st;
      busy.pop_front();
    }
  }
  absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(compute_));
  if (status.ok()) status = st;
  for (uint32_t i = 0; i < run.gs->resident_count && status.ok(); ++i) {
    TimelineEntry e;
    e.subgroup = i;
    e.path = 'r';
    e.k0 = EventUs(run.start, res_events[2 * i]);
    e.k1 = EventUs(run.start, res_events[2 * i + 1]);
    run.kernel_us += e.k1 - e.k0;
    run.gpu_entries.push_back(e);
  }
  for (cudaEvent_t ev : res_events) cudaEventDestroy(ev);
  for (Slot& s : slots) {
    for (cudaEvent_t ev : s.ev) {
      if (ev != nullptr) cudaEventDestroy(ev);
    }
  }
  return status;
}

absl::Status GpuEngine::CpuLoop(StepRun& run) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  ShardState& shard = *run.shard;
  std::span<Subgroup> sgs = shard.subgroups();
  std::span<const TensorInfo> tensors = shard.tensors();
  struct Buffer {
    cudaEvent_t ev[4] = {};  // grads D2H start/end, weights H2D start/end
    bool weights_in_flight = false;
    size_t entry = 0;        // cpu_entries index whose weights are in flight
  };
  Buffer bufs[kCpuBuffers];
  for (Buffer& b : bufs) DOS_RETURN_IF_ERROR(NewEvents(b.ev, 4));
  auto cleanup = [&] {
    for (Buffer& b : bufs) {
      for (cudaEvent_t ev : b.ev) {
        if (ev != nullptr) cudaEventDestroy(ev);
      }
    }
  };
  const bool cast = options_.cpu_grad_fp32;
  auto grad_dtype_sent = [&](DType d) { return cast ? DType::kF32 : d; };

  auto issue_grads = [&](uint32_t sg, int bi) -> absl::Status {
    const Subgroup& g = sgs[sg];
    Buffer& b = bufs[bi];
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[0], cpu_d2h_));
    for (const SubgroupSegment& seg : g.segments) {
      const TensorInfo& t = tensors[seg.tensor];
      const void* src = At(run.bindings[seg.tensor].grad, t.grad_dtype, seg.tensor_offset);
      char* dst = grad_host_[bi] + seg.subgroup_offset * kHostElemBytes;
      if (cast && t.grad_dtype != DType::kF32) {
        float* tmp = cast_dev_[bi] + seg.subgroup_offset;
        DOS_RETURN_IF_ERROR(LaunchCastToFloat(src, t.grad_dtype, seg.count, tmp, cpu_d2h_));
        src = tmp;
      }
      const uint64_t bytes = seg.count * DTypeSize(grad_dtype_sent(t.grad_dtype));
      DOS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cpu_d2h_));
      run.cpu_d2h += bytes;
    }
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[1], cpu_d2h_));
    return absl::OkStatus();
  };
  auto finish_weights = [&](Buffer& b) -> absl::Status {
    if (!b.weights_in_flight) return absl::OkStatus();
    DOS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.ev[3]));
    TimelineEntry& e = run.cpu_entries[b.entry];
    e.out0 = EventUs(run.start, b.ev[2]);
    e.out1 = EventUs(run.start, b.ev[3]);
    b.weights_in_flight = false;
    return absl::OkStatus();
  };

  const absl::Time loop_start = absl::Now();
  absl::Status status;
  std::optional<uint32_t> cur = run.queue->ClaimCpu();
  int bi = 0;
  if (cur) status = issue_grads(*cur, bi);
  std::vector<cpu::CpuUpdater::Item> items;
  while (cur && status.ok()) {
    std::optional<uint32_t> next = run.queue->ClaimCpu();
    if (next) {
      status = issue_grads(*next, (bi + 1) % kCpuBuffers);
      if (!status.ok()) break;
    }
    Buffer& b = bufs[bi];
    status = DOS_CUDA_STATUS(cudaEventSynchronize(b.ev[1]));
    if (!status.ok()) break;
    status = finish_weights(b);
    if (!status.ok()) break;
    const uint32_t g_index = *cur;
    const Subgroup& g = sgs[g_index];
    items.clear();
    for (const SubgroupSegment& seg : g.segments) {
      const TensorInfo& t = tensors[seg.tensor];
      cpu::AdamSpan span{
          .grad = grad_host_[bi] + seg.subgroup_offset * kHostElemBytes,
          .grad_dtype = grad_dtype_sent(t.grad_dtype),
          .master = g.master + seg.subgroup_offset,
          .exp_avg = g.exp_avg + seg.subgroup_offset,
          .exp_avg_sq = g.exp_avg_sq + seg.subgroup_offset,
          .param_out = weight_host_[bi] + seg.subgroup_offset * kHostElemBytes,
          .param_dtype = t.param_dtype,
          .n = seg.count};
      items.push_back({run.scalars[seg.tensor], span});
    }
    TimelineEntry e;
    e.subgroup = *cur;
    e.path = 'c';
    e.in0 = EventUs(run.start, b.ev[0]);
    e.in1 = EventUs(run.start, b.ev[1]);
    shard.BeforeWrite(*cur);  // checkpoint copy-on-write: the kernel writes it
    e.k0 = absl::ToDoubleMicroseconds(absl::Now() - run.t0);
    cpu_->Run(items);
    e.k1 = absl::ToDoubleMicroseconds(absl::Now() - run.t0);
    run.cpu_kernel_us += e.k1 - e.k0;
    run.cpu_params += g.numel;
    run.cpu_entries.push_back(e);
    status = [&]() -> absl::Status {
      // On the GPU path's H2D stream, not a stream of its own: with two
      // streams the copy engine kept serving the GPU path's queued 1.2 GB
      // state copies and left these weights waiting until the GPU path had
      // drained (measured: the CPU sat idle for most of an `auto` step).
      // One stream is FIFO, so the wait is bounded by what is queued now.
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[2], h2d_));
      for (const SubgroupSegment& seg : g.segments) {
        const TensorInfo& t = tensors[seg.tensor];
        void* dst = const_cast<char*>(
            At(run.bindings[seg.tensor].param, t.param_dtype, seg.tensor_offset));
        const uint64_t bytes = seg.count * DTypeSize(t.param_dtype);
        DOS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            dst, weight_host_[bi] + seg.subgroup_offset * kHostElemBytes, bytes,
            cudaMemcpyHostToDevice, h2d_));
        run.cpu_h2d += bytes;
      }
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[3], h2d_));
      DOS_RETURN_IF_ERROR(EnqueueDone(run, &run.cpu_done_calls, g_index, h2d_));
      return absl::OkStatus();
    }();
    b.weights_in_flight = status.ok();
    b.entry = run.cpu_entries.size() - 1;
    cur = next;
    bi = (bi + 1) % kCpuBuffers;
  }
  for (Buffer& b : bufs) {
    absl::Status st = finish_weights(b);
    if (status.ok()) status = st;
  }
  absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(cpu_d2h_));
  if (status.ok()) status = st;
  run.cpu_loop_us = absl::ToDoubleMicroseconds(absl::Now() - loop_start);
  cleanup();
  return status;
}

absl::Status GpuEngine::Update(ShardState& shard, std::span<const TensorBinding> bindings,
                               std::span<const cpu::AdamScalars> scalars, const Policy& policy,
                               const StepSync& sync, StepOutcome* out) {
  absl::MutexLock lock(&step_mu_);
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::InternalError("gpu: shard was not attached to the GPU engine");
  std::span<Subgroup> sgs = shard.subgroups();
  const uint32_t n = static_cast<uint32_t>(sgs.size());
  uint64_t max_numel = 0;
  for (const Subgroup& g : sgs) max_numel = std::max(max_numel, g.numel);
  DOS_RETURN_IF_ERROR(EnsureBuffers(max_numel));

  // Resident share: static:<f> asks for it; auto takes what the budget allows.
  uint32_t resident = 0;
  const uint64_t sg_bytes = max_numel * ShardState::kStateBytesPerParam;
  if (policy.kind == Policy::Kind::kStatic) {
    resident = static_cast<uint32_t>(std::lround(policy.fraction * n));
  } else if (policy.kind == Policy::Kind::kAuto && options_.resident_budget_bytes > 0) {
    resident = static_cast<uint32_t>(std::min<uint64_t>(n, options_.resident_budget_bytes / sg_bytes));
  }
  DOS_RETURN_IF_ERROR(SetResident(shard, resident));

  // Placement of the streamed subgroups.
  std::vector<uint32_t> gpu_only, cpu_only, shared;
  std::vector<uint64_t> numel(n);
  uint64_t streamed_params = 0, resident_params = 0, fixed_gpu_params = 0;
  for (uint32_t i = 0; i < n; ++i) {
    numel[i] = sgs[i].numel;
    if (i < resident) {
      resident_params += sgs[i].numel;
      continue;
    }
    streamed_params += sgs[i].numel;
    switch (policy.kind) {
      case Policy::Kind::kCpu:
      case Policy::Kind::kStatic: cpu_only.push_back(i); break;
      case Policy::Kind::kInterleave:
        if ((i - resident) % static_cast<uint32_t>(policy.stride) == 0) {
          gpu_only.push_back(i);
          fixed_gpu_params += sgs[i].numel;
        } else {
          cpu_only.push_back(i);
        }
        break;
      case Policy::Kind::kAuto: shared.push_back(i); break;
    }
  }
  // Transfer sizes per CPU-path param, from the first tensor's dtypes.
  const TensorInfo& t0 = shard.tensors()[0];
  model_.set_transfer_sizes(
      options_.cpu_grad_fp32 ? 4.0 : static_cast<double>(DTypeSize(t0.grad_dtype)),
      static_cast<double>(DTypeSize(t0.param_dtype)));
  const PerfInputs inputs = model_.inputs();
  double x = 0;
  std::string binding;
  if (policy.kind == Policy::Kind::kAuto) {
    PerfPrediction p = PerfModel::Solve(inputs);
    x = p.gpu_share;
    binding = p.binding;
  } else {
    x = streamed_params > 0 ? static_cast<double>(fixed_gpu_params) / streamed_params : 0;
    binding = PerfModel::Bound(inputs, x).binding;
  }
  if (policy.kind == Policy::Kind::kAuto && shared.size() > 2) {
    // Pre-assign half of each side's share by the model's x: the GPU
    // pipeline owns the front quarter-ish, the CPU pool the back, so both
    // start at once, and the middle stays shared for dynamic claiming (GPU
    // from its front, CPU from its back) to balance the phase's end. Pinning
    // all of x made a misjudged x final (measured: the GPU pipeline idle for
    // the last quarter of a step while the CPU worked through its pins); not
    // pinning at all let the GPU claim nearly everything in the first steps.
    const double total = static_cast<double>(streamed_params);
    const double gpu_pin = 0.5 * x * total;
    const double cpu_pin = 0.5 * (1 - x) * total;
    size_t front = 0, back = shared.size();
    for (double acc = 0; front < shared.size() && acc + sgs[shared[front]].numel <= gpu_pin;
         ++front) {
      acc += static_cast<double>(sgs[shared[front]].numel);
    }
    for (double acc = 0; back > front && acc + sgs[shared[back - 1]].numel <= cpu_pin; --back) {
      acc += static_cast<double>(sgs[shared[back - 1]].numel);
    }
    gpu_only.assign(shared.begin(), shared.begin() + front);
    // The CPU pops its own from the front of cpu_only: the far end first.
    cpu_only.assign(shared.rbegin(), shared.rbegin() + (shared.size() - back));
    shared = std::vector<uint32_t>(shared.begin() + front, shared.begin() + back);
  }
  uint64_t max_streamed = 0;
  for (uint32_t i = resident; i < n; ++i) max_streamed = std::max(max_streamed, sgs[i].numel);
  const double predicted_us =
      PerfModel::PhaseSeconds(inputs, x, static_cast<double>(streamed_params),
                              static_cast<double>(resident_params),
                              static_cast<double>(max_streamed)) * 1e6;

  SubgroupQueue queue(std::move(gpu_only), std::move(cpu_only), std::move(shared),
                      std::move(numel));
  StepRun run;
  run.shard = &shard;
  run.bindings = bindings;
  run.scalars = scalars;
  run.gs = gs;
  run.queue = &queue;
  run.inputs = inputs;
  // The CPU path's throughput as a whole (copies and waits included) is what
  // the claiming rule compares against; the kernel rate alone feeds the model.
  run.cpu_rate = cpu_path_rate_ > 0 ? cpu_path_rate_ : 0.6 * inputs.cpu_params_per_s;
  run.gpu_rate = gpu_path_rate_;
  run.sync = &sync;
  DOS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&run.start));
  DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(run.start, h2d_));
  run.t0 = absl::Now();

  absl::Status gpu_status;
  std::thread gpu_thread([&] {
    pthread_setname_np(pthread_self(), absl::StrCat("dos-gpu-", options_.device).c_str());
    const absl::Time g0 = absl::Now();
    gpu_status = GpuLoop(run);
    run.gpu_loop_us = absl::ToDoubleMicroseconds(absl::Now() - g0);
  });
  absl::Status cpu_status = CpuLoop(run);
  gpu_thread.join();
  absl::Status sync = DOS_CUDA_STATUS(cudaDeviceSynchronize());
  const double wall_us = absl::ToDoubleMicroseconds(absl::Now() - run.t0);
  cudaEventDestroy(run.start);
  DOS_RETURN_IF_ERROR(gpu_status);
  DOS_RETURN_IF_ERROR(cpu_status);
  DOS_RETURN_IF_ERROR(sync);
  if (run.cpu_entries.size() + run.gpu_entries.size() != n) {
    return absl::InternalError(absl::StrCat("gpu: step updated ",
                                            run.cpu_entries.size() + run.gpu_entries.size(),
                                            " of ", n, " subgroups"));
  }

  // Learn from what was measured.
  model_.ObserveCpu(static_cast<double>(run.cpu_params), run.cpu_kernel_us * 1e-6);
  model_.ObserveGpuKernel(static_cast<double>(run.gpu_params), run.kernel_us * 1e-6);
  model_.ObserveH2d(static_cast<double>(run.gpu_h2d), run.h2d_us * 1e-6);
  model_.ObserveD2h(static_cast<double>(run.gpu_d2h), run.d2h_us * 1e-6);
  if (run.cpu_params > 0 && run.cpu_loop_us > 0) {
    const double r = run.cpu_params / (run.cpu_loop_us * 1e-6);
    cpu_path_rate_ = cpu_path_rate_ > 0 ? 0.7 * cpu_path_rate_ + 0.3 * r : r;
  }
  if (run.streamed_params > 0 && run.gpu_loop_us > 0) {
    const double r = run.streamed_params / (run.gpu_loop_us * 1e-6);
    gpu_path_rate_ = gpu_path_rate_ > 0 ? 0.7 * gpu_path_rate_ + 0.3 * r : r;
  }
  if (run.cpu_params > 0 && run.gpu_h2d > 0) {
    const double host_bytes = run.cpu_params * (24.0 + 2 * (inputs.grad_bytes + inputs.weight_bytes)) +
                              2.0 * static_cast<double>(run.gpu_h2d);
    model_.ObserveHostTraffic(host_bytes, wall_us * 1e-6);
  }

  uint64_t resident_count = 0, streamed_count = 0;
  for (const TimelineEntry& e : run.gpu_entries) (e.path == 'r' ? resident_count : streamed_count)++;
  out->cpu_subgroups = run.cpu_entries.size();
  out->gpu_subgroups = streamed_count;
  out->resident_subgroups = resident_count;
  out->cpu_params = run.cpu_params;
  out->gpu_params = run.gpu_params;
  out->h2d_bytes = run.gpu_h2d + run.cpu_h2d;
  out->d2h_bytes = run.gpu_d2h + run.cpu_d2h;
  out->cpu_busy_us = run.cpu_kernel_us;
  out->gpu_busy_us = run.kernel_us;
  out->h2d_busy_us = run.h2d_us;
  out->d2h_busy_us = run.d2h_us;
  out->predicted_us = predicted_us;
  out->model_gpu_share = x;
  out->model_binding = binding;
  out->gpu_memory_bytes = slots_.size() * buffer_numel_ * ShardState::kStateBytesPerParam +
                          cast_dev_.size() * buffer_numel_ * sizeof(float) +
                          resident_bytes_.load();
  ++steps_;
  DOS_LOG_DEBUG("gpu.step", "policy", FormatPolicy(policy), "measured_us", wall_us,
                "predicted_us", predicted_us, "x_model", x, "gpu_subgroups", streamed_count,
                "resident", resident_count, "cpu_subgroups", run.cpu_entries.size(), "binding",
                binding);

  if (!options_.timeline_path.empty()) {
    std::string line = absl::StrFormat(
        "{\"step\":%d,\"policy\":\"%s\",\"wall_us\":%.1f,\"predicted_us\":%.1f,\"entries\":[",
        steps_, FormatPolicy(policy), wall_us, predicted_us);
    bool first = true;
    for (const auto* v : {&run.gpu_entries, &run.cpu_entries}) {
      for (const TimelineEntry& e : *v) {
        absl::StrAppend(&line, first ? "" : ",",
                        absl::StrFormat("{\"sg\":%d,\"path\":\"%c\",\"in\":[%.1f,%.1f],"
                                        "\"kernel\":[%.1f,%.1f],\"out\":[%.1f,%.1f]}",
                                        e.subgroup, e.path, e.in0, e.in1, e.k0, e.k1, e.out0,
                                        e.out1));
        first = false;
      }
    }
    absl::StrAppend(&line, "]}\n");
    if (FILE* f = std::fopen(options_.timeline_path.c_str(), "a")) {
      std::fwrite(line.data(), 1, line.size(), f);
      std::fclose(f);
    }
  }
  return absl::OkStatus();
}

}  // namespace dos::gpu
