#include "daemon/cpu/host_engine.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/cpu/delayed_update.h"
#include "daemon/cpu/subgroup_spans.h"
#include "dos/wire/status_macros.h"
#include "daemon/transport/shm_transport.h"

namespace dos::cpu {

std::unique_ptr<Transport> HostEngine::NewTransport() { return std::make_unique<ShmTransport>(); }

absl::StatusOr<void*> HostEngine::OpenTrainerEvent(const std::string&) {
  return absl::InvalidArgumentError(
      "register: cuda_ipc_event was sent but the tensors are in shared memory; send an event "
      "only with CUDA IPC tensors");
}

absl::Status HostEngine::WaitTrainerEvent(void*) {
  return absl::InvalidArgumentError(
      "step: flag kStepTrainerEventRecorded is set but the session's tensors are in shared "
      "memory; clear the flag");
}

absl::Status HostEngine::SyncTrainerEvent(void* event) { return WaitTrainerEvent(event); }

absl::Status HostEngine::CopyToHost(void* dst, const void* trainer_src, uint64_t bytes) {
  std::memcpy(dst, trainer_src, bytes);
  return absl::OkStatus();
}

absl::Status HostEngine::CopyToTrainer(void* trainer_dst, const void* src, uint64_t bytes) {
  std::memcpy(trainer_dst, src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<bool> HostEngine::AllFinite(const ShardState& shard,
                                           std::span<const TensorBinding> bindings) {
  std::span<const TensorDesc> tensors = shard.tensors();
  std::vector<CpuUpdater::GradRun> runs;
  runs.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    runs.push_back({bindings[t].grad, tensors[t].grad_dtype, tensors[t].numel});
  }
  return cpu_->AllFinite(runs);
}

absl::Status HostEngine::Execute(const StepPlan& plan, ShardState& shard,
                                 std::span<const TensorBinding> bindings,
                                 std::span<const AdamScalars> scalars, const StepSync& sync,
                                 StepMeasurements* measured) {
  if (plan.resident != 0 || !plan.gpu_only.empty() || !plan.shared.empty() ||
      plan.cpu_only.size() + plan.delayed.size() != shard.subgroups().size() ||
      (!plan.delayed.empty() && sync.delayed == nullptr)) {
    return absl::InternalError(absl::StrCat(
        "host engine: the plan places ", plan.resident + plan.gpu_only.size() + plan.shared.size(),
        " subgroups off the CPU; a host session's plan must be all CPU"));
  }
  const absl::Time start = absl::Now();
  std::span<const TensorDesc> tensors = shard.tensors();
  std::vector<CpuUpdater::Item> items;
  // A plan that waits for each subgroup's gradients (plan.wait_ready)
  // updates each one as soon as they are final, in the plan's order; the
  // time spent waiting for them is not the update's.
  double wait_us = 0;
  // During a checkpoint, last first (ShardState::BeforeWrites says why): the
  // step copies what the file has not reached and meets the writer once.
  std::vector<uint32_t> order(plan.cpu_only.begin(), plan.cpu_only.end());
  if (shard.snapshot_in_progress() && !plan.wait_ready) std::reverse(order.begin(), order.end());
  for (uint32_t sg : order) {
    if (plan.wait_ready) {
      const absl::Time w0 = absl::Now();
      absl::Status ready = sync.wait_ready(sg);
      wait_us += absl::ToDoubleMicroseconds(absl::Now() - w0);
      if (!ready.ok()) return ready;
    }
    const Subgroup& g = shard.subgroups()[sg];
    absl::Status st = ForEachSegmentSpan(
        tensors, g, g.master,
        [&](const SubgroupSegment& seg, const TensorDesc& t) {
          return TrainerIo(t, seg, bindings[seg.tensor].grad, bindings[seg.tensor].param);
        },
        [&](const SubgroupSegment& seg, const AdamSpan& span) {
          items.push_back({scalars[seg.tensor], span});
          return absl::OkStatus();
        });
    if (!st.ok()) return st;
    // One subgroup at a time when it was waited for, or for a checkpoint's
    // copy-on-write (in order).
    if (plan.wait_ready || shard.snapshot_in_progress()) {
      shard.BeforeWrite(sg);
      cpu_->Run(items);
      items.clear();
    }
    measured->cpu_params += g.numel;
    measured->entries.push_back(TimelineEntry{.subgroup = sg, .path = 'c'});
  }
  cpu_->Run(items);
  // A delayed step: the delayed subgroups' pending weights in, their
  // gradients out (the update runs after the result: UpdateDelayed).
  if (!plan.delayed.empty()) {
    DOS_RETURN_IF_ERROR(CopyDelayedHost(shard, bindings, *sync.delayed, plan.delayed, true));
    if (sync.delayed_captured) sync.delayed_captured();
    for (uint32_t sg : plan.delayed) {
      measured->entries.push_back(TimelineEntry{.subgroup = sg, .path = 'd'});
    }
  }
  measured->wall_us = absl::ToDoubleMicroseconds(absl::Now() - start) - wait_us;
  measured->cpu_kernel_us = measured->wall_us;
  measured->cpu_loop_us = measured->wall_us;
  return absl::OkStatus();
}

}  // namespace dos::cpu

namespace dos::cpu {

absl::StatusOr<HostBuffer> HostEngine::AllocStaging(uint64_t bytes) {
  char* p = static_cast<char*>(::operator new(bytes, std::align_val_t{64}, std::nothrow));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return HostBuffer(p, [](char* q) { ::operator delete(q, std::align_val_t{64}); });
}

absl::Status HostEngine::InstallDelayed(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        const DelayedHost& delayed,
                                        std::span<const uint32_t> subgroups) {
  return CopyDelayedHost(shard, bindings, delayed, subgroups, false);
}

absl::Status HostEngine::CaptureDelayed(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        const DelayedHost& delayed,
                                        std::span<const uint32_t> subgroups) {
  return CopyDelayedHost(shard, bindings, delayed, subgroups, true);
}

absl::Status HostEngine::UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                                       double* kernel_us) {
  return cpu::UpdateDelayed(delayed_cpu_, shard, delayed, kernel_us);
}

}  // namespace dos::cpu
