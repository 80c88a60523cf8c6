// GpuEngine's GPU path: the resident subgroups' kernels, then the streamed
// subgroups through the staging slots (H2D, kernel, D2H on three streams),
// claimed from the plan's queue. Runs on the engine's worker thread.
#include <algorithm>
#include <iterator>
#include <optional>

#include "daemon/cpu/subgroup_spans.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/gpu/gpu_step.h"

namespace dos::gpu {
namespace {

// A delayed update's gradients and weights staged in a slot (`base`, after
// its state): the delayed buffers' layout, `numel` elements a stride, each
// part on kStagedIoAlign bytes (the kernel's four-element loads).
struct StagedIo {
  char* base = nullptr;  // null: not staged
  uint64_t numel = 0;
  static uint64_t Up(uint64_t bytes) {
    return (bytes + kStagedIoAlign - 1) / kStagedIoAlign * kStagedIoAlign;
  }
  char* grad(const DelayedHost& d, uint64_t offset) const { return base + offset * d.grad_elem(); }
  char* weight(const DelayedHost& d, uint64_t offset) const {
    return base + Up(numel * d.grad_elem()) + offset * d.weight_elem();
  }
};

// The fused kernel over every segment of subgroup `g` whose state is at
// `state` (a staging slot or a resident copy), on `stream`.
// A delayed update's (run.delayed_io) reads the gradients from and writes
// the weights to the delayed buffers: staged in the slot (`io`), or in
// page-locked host memory the kernel reaches over PCIe (unified addressing:
// cudaHostAlloc's pointers are the device's too), its grid then capped at
// run.delayed_kernel_blocks.
absl::Status LaunchSubgroup(const GpuEngine::StepRun& run, uint32_t sg, float* state,
                            cudaStream_t stream, StagedIo io = {}) {
  const Subgroup& g = run.shard->subgroups()[sg];
  const DelayedHost* const d = run.delayed_io;
  return cpu::ForEachSegmentSpan(
      run.shard->tensors(), g, state,
      [&](const SubgroupSegment& seg, const TensorDesc& t) {
        if (d != nullptr && io.base != nullptr) {
          return cpu::SegmentIo{io.grad(*d, seg.subgroup_offset), t.grad_dtype,
                                io.weight(*d, seg.subgroup_offset), t.param_dtype};
        }
        if (d != nullptr) {
          return cpu::SegmentIo{d->grad(sg, seg), t.grad_dtype, d->weight(sg, seg), t.param_dtype};
        }
        return cpu::TrainerIo(t, seg, run.bindings[seg.tensor].grad,
                              run.bindings[seg.tensor].param);
      },
      [&](const SubgroupSegment& seg, const cpu::AdamSpan& s) {
        const DeviceAdamSpan span{
            .grad = s.grad,
            .grad_dtype = s.grad_dtype,
            .master = s.master,
            .exp_avg = s.exp_avg,
            .exp_avg_sq = s.exp_avg_sq,
            .param_out = s.param_out,
            .param_dtype = s.param_dtype,
            .n = s.n,
            .exp_avg_bf16 = s.exp_avg_bf16,
            .exp_avg_sq_bf16 = s.exp_avg_sq_bf16,
            .element_offset = s.element_offset,
            .max_blocks = d != nullptr && io.base == nullptr ? run.delayed_kernel_blocks : 0u};
        const std::span<const cpu::AdamScalars> scalars =
            d != nullptr ? d->scalars_for(sg) : run.scalars;
        return LaunchAdam(scalars[seg.tensor], span, stream);
      });
}

// The staging-slot pipeline of one step: slots in flight oldest first, each
// with its six events (H2D start/end, kernel start/end, D2H start/end).
class StreamPipeline {
 public:
  struct Streams {
    cudaStream_t h2d, compute, d2h;
  };
  // `io_numel`: a delayed update's gradients and weights are staged in each
  // slot after its state, `io_numel` elements a stride (0: not staged).
  StreamPipeline(GpuEngine::StepRun& run, Streams streams, std::span<float* const> slots,
                 uint64_t io_numel = 0)
      : run_(run), streams_(streams), buffers_(slots), io_numel_(io_numel), slots_(slots.size()) {
    for (int i = static_cast<int>(slots.size()) - 1; i >= 0; --i) free_.push_back(i);
    for (size_t i = 0; i < slots_.size() && i < run.prefetched.size(); ++i) {
      slots_[i].prefetched = run.prefetched[i];
    }
  }
  ~StreamPipeline() {
    for (Slot& s : slots_) DestroyEvents(s.ev);
  }

  absl::Status Init() {
    for (Slot& s : slots_) DOS_RETURN_IF_ERROR(NewEvents(s.ev, 6));
    return absl::OkStatus();
  }
  bool full() const { return free_.empty(); }
  size_t in_flight() const { return busy_.size(); }

  // Waits for the oldest slot's D2H and records its timeline entry.
  absl::Status RetireOldest() {
    Slot& s = slots_[busy_.front()];
    absl::Status st = DOS_CUDA_STATUS(cudaEventSynchronize(s.ev[5]));
    if (st.ok()) {
      TimelineEntry e{.subgroup = s.subgroup, .path = 'g'};
      double* t[6] = {&e.in0, &e.in1, &e.k0, &e.k1, &e.out0, &e.out1};
      for (int i = 0; i < 6; ++i) *t[i] = EventUs(run_.start, s.ev[i]);
      run_.h2d_us += e.in1 - e.in0;
      run_.kernel_us += e.k1 - e.k0;
      run_.d2h_us += e.out1 - e.out0;
      run_.gpu_entries.push_back(e);
    }
    free_.push_back(busy_.front());
    busy_.pop_front();
    return st;
  }

  // Sends subgroup `sg` through a free slot: the one its state was
  // prefetched into if it was, else one holding no prefetched state if any.
  absl::Status Issue(uint32_t sg) {
    auto pick = [&](auto pred) {
      for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
        if (pred(slots_[*it])) return std::prev(it.base());
      }
      return free_.end();
    };
    auto it = pick([&](const Slot& s) { return s.prefetched == static_cast<int64_t>(sg); });
    if (it == free_.end()) it = pick([](const Slot& s) { return s.prefetched < 0; });
    if (it == free_.end()) it = std::prev(free_.end());
    const int si = *it;
    free_.erase(it);
    busy_.push_back(si);
    Slot& s = slots_[si];
    s.subgroup = sg;
    const bool prefetched = s.prefetched == static_cast<int64_t>(sg);
    s.prefetched = -1;  // the slot's content is this step's from now on
    const Subgroup& g = run_.shard->subgroups()[sg];
    run_.shard->BeforeWrite(sg);  // checkpoint copy-on-write: the D2H below writes it back
    float* state = buffers_[si];
    const uint64_t bytes = StateBytes(g);
    run_.gpu_params += g.numel;
    run_.streamed_params += g.numel;
    run_.gpu_d2h += bytes;
    // A prefetched slot's copy was queued on the same H2D stream before:
    // the events below complete after it.
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[0], streams_.h2d));
    if (prefetched) {
      run_.prefetched_bytes += bytes;
      run_.prefetched_params += g.numel;
    } else {
      run_.gpu_h2d += bytes;
      DOS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(state, g.master, bytes, cudaMemcpyHostToDevice, streams_.h2d));
    }
    const StagedIo io = Staged(si);
    if (io.base != nullptr) {  // the delayed update's gradients, beside the state
      const uint64_t n = g.numel * run_.delayed_io->grad_elem();
      run_.gpu_h2d += n;
      DOS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(io.base, run_.delayed_io->grad_region(sg), n,
                                               cudaMemcpyHostToDevice, streams_.h2d));
    }
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[1], streams_.h2d));
    // Early step: the state is on its way; the kernel waits for the
    // subgroup's gradients.
    DOS_RETURN_IF_ERROR(WaitReady(run_, sg, &run_.gpu_wait_us));
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(streams_.compute, s.ev[1], 0));
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[2], streams_.compute));
    DOS_RETURN_IF_ERROR(LaunchSubgroup(run_, sg, state, streams_.compute, io));
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[3], streams_.compute));
    // The trainer's weights are final once the kernel ran (the state's way
    // back to the host does not concern it).
    DOS_RETURN_IF_ERROR(EnqueueDone(run_, &run_.gpu_done_calls, sg, streams_.compute));
    DOS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(streams_.d2h, s.ev[3], 0));
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[4], streams_.d2h));
    DOS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(g.master, state, bytes, cudaMemcpyDeviceToHost, streams_.d2h));
    if (io.base != nullptr) {  // the delayed update's new weights
      const uint64_t n = g.numel * run_.delayed_io->weight_elem();
      run_.gpu_d2h += n;
      DOS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(run_.delayed_io->weight_region(sg),
                                               io.weight(*run_.delayed_io, 0), n,
                                               cudaMemcpyDeviceToHost, streams_.d2h));
    }
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.ev[5], streams_.d2h));
    return absl::OkStatus();
  }

  // Retires every slot in flight; the first error wins.
  absl::Status Drain(absl::Status status) {
    while (!busy_.empty()) {
      absl::Status st = RetireOldest();
      if (status.ok()) status = st;
    }
    return status;
  }

 private:
  StagedIo Staged(int si) const {
    if (io_numel_ == 0 || run_.delayed_io == nullptr) return {};
    return {reinterpret_cast<char*>(buffers_[si]) +
                StagedIo::Up(io_numel_ * ShardState::kStateBytesPerParam),
            io_numel_};
  }

  struct Slot {
    uint32_t subgroup = 0;
    int64_t prefetched = -1;  // subgroup whose state Prefetch put here, unused yet
    cudaEvent_t ev[6] = {};
  };
  GpuEngine::StepRun& run_;
  const Streams streams_;
  std::span<float* const> buffers_;
  const uint64_t io_numel_;
  std::vector<Slot> slots_;
  std::deque<int> busy_;
  std::vector<int> free_;
};

}  // namespace

absl::Status EnqueueDone(GpuEngine::StepRun& run, std::deque<GpuEngine::StepRun::DoneCall>* calls,
                         uint32_t first, uint32_t last, cudaStream_t stream) {
  if (run.sync == nullptr || !run.sync->subgroup_done) return absl::OkStatus();
  calls->push_back({run.sync, std::min(first, last), std::max(first, last)});
  DOS_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
      stream,
      [](void* arg) {
        const auto* call = static_cast<const GpuEngine::StepRun::DoneCall*>(arg);
        for (uint32_t sg = call->first; sg <= call->last; ++sg) call->sync->subgroup_done(sg);
      },
      &calls->back()));
  return absl::OkStatus();
}

absl::Status GpuEngine::StreamSubgroups(StepRun& run) {
  StreamPipeline pipe(run, {h2d_, compute_, d2h_}, slots_);
  absl::Status status = pipe.Init();
  // The plan's rule for shared subgroups (auto's dynamic claiming).
  auto take = [&](const SubgroupQueue::SharedClaim& claim) {
    return run.plan->TakeShared(claim, pipe.in_flight());
  };
  while (status.ok()) {
    if (pipe.full()) {
      status = pipe.RetireOldest();
      continue;
    }
    std::optional<uint32_t> claim = run.queue->ClaimGpu(take);
    if (!claim) {
      if (pipe.in_flight() == 0 || !run.queue->GpuMayHaveWork()) break;
      status = pipe.RetireOldest();  // a freed slot may change the answer
      continue;
    }
    status = pipe.Issue(*claim);
  }
  return pipe.Drain(status);
}

absl::Status GpuEngine::StreamDelayed(StepRun& run, std::span<const uint32_t> subgroups) {
  // The kernels run beside the trainer's forward and backward, reading the
  // gradients over PCIe (or, delayed_staged, from the slot, copied beside
  // the state): on the low-priority stream (idle between steps), not ahead
  // of the trainer's kernels.
  StreamPipeline pipe(run, {h2d_, resident_, d2h_}, slots_,
                      options_.delayed_staged ? buffer_numel_ : 0);
  absl::Status status = pipe.Init();
  for (size_t k = 0; k < subgroups.size() && status.ok();) {
    if (pipe.full()) {
      status = pipe.RetireOldest();
    } else {
      status = pipe.Issue(subgroups[k++]);
    }
  }
  return pipe.Drain(status);
}

absl::Status GpuEngine::GpuLoop(StepRun& run) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  std::span<Subgroup> sgs = run.shard->subgroups();
  // Resident subgroups: kernels only, on their own low-priority stream (the
  // streamed subgroups' kernels do not queue behind them); before or after
  // the streamed subgroups and in the order the plan gives.
  const StepPlan& plan = *run.plan;
  std::vector<cudaEvent_t> res_events(2 * run.gs->resident_count);
  absl::Status status = NewEvents(res_events.data(), static_cast<int>(res_events.size()));
  if (!plan.resident_first && status.ok()) status = StreamSubgroups(run);
  // Their progress in runs of kResidentDoneRun subgroups (one host function
  // each; the order runs up or down, so a run is a range), or one at a time
  // where the plan waits for each subgroup's gradients.
  constexpr size_t kResidentDoneRun = 4;
  const size_t run_of = plan.wait_ready ? 1 : kResidentDoneRun;
  for (size_t k = 0; k < plan.resident_order.size() && status.ok(); ++k) {
    const uint32_t i = plan.resident_order[k];
    status = [&]() -> absl::Status {
      DOS_RETURN_IF_ERROR(WaitReady(run, i, &run.gpu_wait_us));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_events[2 * i], resident_));
      DOS_RETURN_IF_ERROR(LaunchSubgroup(run, i, run.gs->resident[i], resident_));
      DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(res_events[2 * i + 1], resident_));
      if ((k + 1) % run_of != 0 && k + 1 != plan.resident_order.size()) return absl::OkStatus();
      return EnqueueDone(run, &run.gpu_done_calls, plan.resident_order[k - k % run_of], i,
                         resident_);
    }();
    run.gpu_params += sgs[i].numel;
  }
  if (plan.resident_first && status.ok()) status = StreamSubgroups(run);
  absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(resident_));
  if (status.ok()) status = st;
  st = DOS_CUDA_STATUS(cudaStreamSynchronize(compute_));
  if (status.ok()) status = st;
  for (uint32_t i = 0; i < run.gs->resident_count && status.ok(); ++i) {
    TimelineEntry e{.subgroup = i, .path = 'r'};
    e.k0 = EventUs(run.start, res_events[2 * i]);
    e.k1 = EventUs(run.start, res_events[2 * i + 1]);
    run.kernel_us += e.k1 - e.k0;
    run.gpu_entries.push_back(e);
  }
  DestroyEvents(res_events);
  return status;
}

}  // namespace dos::gpu
