// GpuEngine's CPU path: per subgroup claimed from the plan's queue, the
// gradients D2H into a pinned buffer (cast to fp32 on the GPU first with
// cpu_grad_fp32), the CPU kernel over the page-locked host state, the new
// weights H2D into the trainer's memory; the next subgroup's gradients are
// in flight while the CPU works. Runs on the step's thread.
//
// The copies are kernels (pcie_copy.h) on the CPU path's own streams by
// default: through the copy engines they queued behind the GPU path's state
// copies and left the CPU idle (GpuEngineOptions::cpu_copy_kernel).
#include <optional>

#include "absl/time/clock.h"
#include "daemon/cpu/subgroup_spans.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/gpu/gpu_step.h"
#include "daemon/gpu/pcie_copy.h"

namespace dos::gpu {
namespace {

class CpuPipeline {
 public:
  struct Buffers {
    std::span<char* const> grad_host, weight_host;  // pinned, kCpuBuffers each
    std::span<float* const> cast_dev;               // device, cpu_grad_fp32 by DMA only
    bool copy_kernel = true;                        // GpuEngineOptions::cpu_copy_kernel
    bool cast = false;                              // GpuEngineOptions::cpu_grad_fp32
  };
  CpuPipeline(GpuEngine::StepRun& run, cudaStream_t d2h, cudaStream_t h2d, Buffers buffers,
              cpu::CpuUpdater* cpu)
      : run_(run), d2h_(d2h), h2d_(h2d), buf_(buffers), cpu_(cpu) {}
  ~CpuPipeline() {
    for (Buffer& b : bufs_) DestroyEvents(b.ev);
  }
  absl::Status Init() {
    for (Buffer& b : bufs_) DOS_RETURN_IF_ERROR(NewEvents(b.ev, 4));
    return absl::OkStatus();
  }

  // Queues subgroup `sg`'s gradients D2H into buffer `bi`.
  absl::Status IssueGrads(uint32_t sg, int bi) {
    const Subgroup& g = run_.shard->subgroups()[sg];
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(bufs_[bi].ev[0], d2h_));
    for (const SubgroupSegment& seg : g.segments) {
      const TensorDesc& t = run_.shard->tensors()[seg.tensor];
      const void* src = cpu::ElementAt(run_.bindings[seg.tensor].grad, t.grad_dtype,
                                       seg.tensor_offset);
      char* dst = buf_.grad_host[bi] + seg.subgroup_offset * kHostElemBytes;
      const uint64_t bytes = seg.count * DTypeSize(SentGradDtype(t.grad_dtype));
      run_.cpu_d2h += bytes;
      if (cast() && t.grad_dtype != DType::kF32) {
        if (buf_.copy_kernel) {  // the cast kernel stores into the host buffer itself
          DOS_RETURN_IF_ERROR(LaunchCastToFloat(src, t.grad_dtype, seg.count,
                                                reinterpret_cast<float*>(dst), d2h_));
          continue;
        }
        float* tmp = buf_.cast_dev[bi] + seg.subgroup_offset;
        DOS_RETURN_IF_ERROR(LaunchCastToFloat(src, t.grad_dtype, seg.count, tmp, d2h_));
        src = tmp;
      }
      DOS_RETURN_IF_ERROR(Copy(dst, src, bytes, cudaMemcpyDeviceToHost, d2h_));
    }
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(bufs_[bi].ev[1], d2h_));
    return absl::OkStatus();
  }

  // Updates subgroup `sg` from buffer `bi` (its gradients issued before)
  // and queues its weights H2D.
  absl::Status Update(uint32_t sg, int bi) {
    Buffer& b = bufs_[bi];
    DOS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.ev[1]));
    DOS_RETURN_IF_ERROR(FinishWeights(b));
    const Subgroup& g = run_.shard->subgroups()[sg];
    items_.clear();
    DOS_RETURN_IF_ERROR(cpu::ForEachSegmentSpan(
        run_.shard->tensors(), g, g.master,
        [&](const SubgroupSegment& seg, const TensorDesc& t) {
          return cpu::SegmentIo{buf_.grad_host[bi] + seg.subgroup_offset * kHostElemBytes,
                                SentGradDtype(t.grad_dtype),
                                buf_.weight_host[bi] + seg.subgroup_offset * kHostElemBytes,
                                t.param_dtype};
        },
        [&](const SubgroupSegment& seg, const cpu::AdamSpan& span) {
          items_.push_back({run_.scalars[seg.tensor], span});
          return absl::OkStatus();
        }));
    TimelineEntry e{.subgroup = sg, .path = 'c'};
    e.in0 = EventUs(run_.start, b.ev[0]);
    e.in1 = EventUs(run_.start, b.ev[1]);
    run_.shard->BeforeWrite(sg);  // checkpoint copy-on-write: the kernel writes it
    e.k0 = absl::ToDoubleMicroseconds(absl::Now() - run_.t0);
    cpu_->Run(items_);
    e.k1 = absl::ToDoubleMicroseconds(absl::Now() - run_.t0);
    run_.cpu_kernel_us += e.k1 - e.k0;
    run_.cpu_params += g.numel;
    run_.cpu_entries.push_back(e);
    absl::Status st = IssueWeights(sg, bi);
    b.weights_in_flight = st.ok();
    b.entry = run_.cpu_entries.size() - 1;
    return st;
  }

  // Waits for every weight copy in flight.
  absl::Status Finish(absl::Status status) {
    for (Buffer& b : bufs_) {
      absl::Status st = FinishWeights(b);
      if (status.ok()) status = st;
    }
    absl::Status st = DOS_CUDA_STATUS(cudaStreamSynchronize(d2h_));
    return status.ok() ? st : status;
  }

 private:
  struct Buffer {
    cudaEvent_t ev[4] = {};  // grads D2H start/end, weights H2D start/end
    bool weights_in_flight = false;
    size_t entry = 0;        // cpu_entries index whose weights are in flight
  };
  bool cast() const { return buf_.cast; }

  absl::Status Copy(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind,
                    cudaStream_t stream) {
    if (buf_.copy_kernel) return LaunchPcieCopy(dst, src, bytes, stream);
    return DOS_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, kind, stream));
  }
  DType SentGradDtype(DType d) const { return cast() ? DType::kF32 : d; }

  absl::Status IssueWeights(uint32_t sg, int bi) {
    // By DMA on the GPU path's H2D stream, not a stream of its own: with
    // two streams the copy engine kept serving the GPU path's queued 1.2 GB
    // state copies and left these weights waiting until the GPU path had
    // drained (measured: the CPU sat idle for most of an `auto` step). One
    // stream is FIFO, so the wait is bounded by what is queued now. A copy
    // kernel (the default) waits for neither, on the CPU path's H2D stream.
    const Subgroup& g = run_.shard->subgroups()[sg];
    Buffer& b = bufs_[bi];
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[2], h2d_));
    for (const SubgroupSegment& seg : g.segments) {
      const TensorDesc& t = run_.shard->tensors()[seg.tensor];
      void* dst = cpu::ElementAt(run_.bindings[seg.tensor].param, t.param_dtype, seg.tensor_offset);
      const uint64_t bytes = seg.count * DTypeSize(t.param_dtype);
      DOS_RETURN_IF_ERROR(Copy(dst, buf_.weight_host[bi] + seg.subgroup_offset * kHostElemBytes,
                               bytes, cudaMemcpyHostToDevice, h2d_));
      run_.cpu_h2d += bytes;
    }
    DOS_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[3], h2d_));
    return EnqueueDone(run_, &run_.cpu_done_calls, sg, h2d_);
  }

  absl::Status FinishWeights(Buffer& b) {
    if (!b.weights_in_flight) return absl::OkStatus();
    DOS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.ev[3]));
    TimelineEntry& e = run_.cpu_entries[b.entry];
    e.out0 = EventUs(run_.start, b.ev[2]);
    e.out1 = EventUs(run_.start, b.ev[3]);
    b.weights_in_flight = false;
    return absl::OkStatus();
  }

  GpuEngine::StepRun& run_;
  const cudaStream_t d2h_, h2d_;
  const Buffers buf_;
  cpu::CpuUpdater* const cpu_;
  Buffer bufs_[kCpuBuffers];
  std::vector<cpu::CpuUpdater::Item> items_;
};

}  // namespace

absl::Status GpuEngine::CpuLoop(StepRun& run) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const bool kernel = options_.cpu_copy_kernel;
  CpuPipeline pipe(run, cpu_d2h_, kernel ? cpu_h2d_ : h2d_,
                   {grad_host_, weight_host_, cast_dev_, kernel, options_.cpu_grad_fp32}, cpu_);
  const absl::Time loop_start = absl::Now();
  absl::Status status = pipe.Init();
  std::optional<uint32_t> cur = status.ok() ? run.queue->ClaimCpu() : std::nullopt;
  int bi = 0;
  if (cur) {
    status = WaitReady(run, *cur, &run.cpu_wait_us);
    if (status.ok()) status = pipe.IssueGrads(*cur, bi);
  }
  while (cur && status.ok()) {
    std::optional<uint32_t> next = run.queue->ClaimCpu();
    // The next subgroup's gradients travel while the CPU updates this one;
    // in a plan that waits for each subgroup only if they are final already,
    // else after it.
    const bool next_first = next && (!run.plan->wait_ready || run.sync->is_ready(*next));
    if (next_first) {
      status = pipe.IssueGrads(*next, (bi + 1) % kCpuBuffers);
      if (!status.ok()) break;
    }
    status = pipe.Update(*cur, bi);
    if (status.ok()) run.queue->CpuDone(*cur);
    if (status.ok() && next && !next_first) {
      status = WaitReady(run, *next, &run.cpu_wait_us);
      if (status.ok()) status = pipe.IssueGrads(*next, (bi + 1) % kCpuBuffers);
    }
    cur = next;
    bi = (bi + 1) % kCpuBuffers;
  }
  status = pipe.Finish(status);
  run.cpu_loop_us = absl::ToDoubleMicroseconds(absl::Now() - loop_start);
  return status;
}

}  // namespace dos::gpu
