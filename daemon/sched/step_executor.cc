#include "daemon/sched/step_executor.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dos/wire/status_macros.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_for.h"
#include "daemon/cpu/adam_kernel.h"

namespace dos {
namespace {

absl::Status BadGroup(size_t group, absl::string_view field, double value, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat("step: group ", group, " ", field, " = ", value,
                                                 " is invalid; it must be ", want));
}

const char* ElementPtr(const void* base, DType dtype, uint64_t offset) {
  return static_cast<const char*>(base) + offset * DTypeSize(dtype);
}

}  // namespace

absl::Status ValidateStepRequest(const StepRequest& r, size_t num_groups) {
  if (r.num_groups != num_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: request carries ", r.num_groups, " param groups but ", num_groups,
                     " were registered; send hyperparameters for every registered group"));
  }
  if (!std::isfinite(r.grad_scale) || r.grad_scale <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: grad_scale = ", r.grad_scale, " is invalid; it must be finite and > 0 (1 = none)"));
  }
  if (!std::isfinite(r.clip_coef) || r.clip_coef < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: clip_coef = ", r.clip_coef, " is invalid; it must be finite and >= 0 (1 = none)"));
  }
  for (size_t i = 0; i < num_groups; ++i) {
    const GroupStepParams& g = r.groups[i];
    if (!std::isfinite(g.lr) || g.lr < 0) return BadGroup(i, "lr", g.lr, "finite and >= 0");
    if (!(g.beta1 >= 0 && g.beta1 < 1)) return BadGroup(i, "beta1", g.beta1, "in [0, 1)");
    if (!(g.beta2 >= 0 && g.beta2 < 1)) return BadGroup(i, "beta2", g.beta2, "in [0, 1)");
    if (!std::isfinite(g.eps) || g.eps <= 0) return BadGroup(i, "eps", g.eps, "finite and > 0");
    if (!std::isfinite(g.weight_decay) || g.weight_decay < 0) {
      return BadGroup(i, "weight_decay", g.weight_decay, "finite and >= 0");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> StepExecutor::Run(ShardState& shard,
                                              std::span<const TensorBinding> bindings,
                                              const StepRequest& request, const Policy& policy,
                                              const StepSync& sync) {
  absl::Status valid = ValidateStepRequest(request, shard.groups().size());
  if (!valid.ok()) return valid;
  const absl::Time start = absl::Now();
  std::span<TensorInfo> tensors = shard.tensors();
  StepOutcome out;
  // GPU mode: the session's tensors live in GPU memory (CUDA IPC).
  const bool device = !bindings.empty() && bindings[0].device;
  if (device && gpu_ == nullptr) {
    return absl::FailedPreconditionError(
        "step: the session's tensors are in GPU memory but this daemon has no GPU engine");
  }

  if (request.flags & kStepTrainerEventRecorded) {
    if (!device || sync.trainer_event == nullptr) {
      return absl::InvalidArgumentError(
          "step: flag kStepTrainerEventRecorded is set but the session registered no CUDA IPC "
          "event (RegisterShard.cuda_ipc_event) or its tensors are not in GPU memory; clear the "
          "flag or register the event");
    }
    absl::Status st = gpu_->WaitTrainerEvent(sync.trainer_event);
    if (!st.ok()) return st;
  }

  if (!(request.flags & kStepGradientsChecked)) {
    bool finite = true;
    if (device) {
      absl::StatusOr<bool> f = gpu_->AllFinite(shard, bindings);
      if (!f.ok()) return f.status();
      finite = *f;
    } else {
      std::vector<cpu::CpuUpdater::GradRun> runs;
      runs.reserve(tensors.size());
      for (size_t t = 0; t < tensors.size(); ++t) {
        runs.push_back({bindings[t].grad, tensors[t].grad_dtype, tensors[t].numel});
      }
      finite = cpu_->AllFinite(runs);
    }
    if (!finite) {
      out.found_inf = true;
      out.step = tensors[0].step;
      out.update_us = absl::ToDoubleMicroseconds(absl::Now() - start);
      return out;
    }
  }

  // The scalars depend on the tensor's group and step count only: compute
  // them once per tensor, not per run.
  std::vector<cpu::AdamScalars> scalars;
  scalars.reserve(tensors.size());
  for (const TensorInfo& t : tensors) {
    const GroupConfig& group = shard.groups()[t.group];
    scalars.push_back(cpu::MakeAdamScalars(request.groups[t.group], group.decoupled_weight_decay,
                                           t.step + 1, request.grad_scale, request.clip_coef));
  }
  if (device) {
    absl::Status st = gpu_->Update(shard, bindings, scalars, policy, sync, &out);
    if (!st.ok()) return st;
  } else {
    std::vector<cpu::CpuUpdater::Item> items;
    for (const Subgroup& g : shard.subgroups()) {
      for (const SubgroupSegment& seg : g.segments) {
        const TensorInfo& t = tensors[seg.tensor];
        const TensorBinding& b = bindings[seg.tensor];
        cpu::AdamSpan span{
            .grad = ElementPtr(b.grad, t.grad_dtype, seg.tensor_offset),
            .grad_dtype = t.grad_dtype,
            .master = g.master + seg.subgroup_offset,
            .exp_avg = g.exp_avg + seg.subgroup_offset,
            .exp_avg_sq = g.exp_avg_sq + seg.subgroup_offset,
            .param_out = const_cast<char*>(ElementPtr(b.param, t.param_dtype, seg.tensor_offset)),
            .param_dtype = t.param_dtype,
            .n = seg.count,
        };
        items.push_back({scalars[seg.tensor], span});
      }
      ++out.cpu_subgroups;
      if (shard.snapshot_in_progress()) {  // checkpoint copy-on-write: per subgroup, in order
        shard.BeforeWrite(static_cast<uint32_t>(&g - shard.subgroups().data()));
        cpu_->Run(items);
        items.clear();
      }
    }
    cpu_->Run(items);
  }
  for (TensorInfo& t : tensors) ++t.step;
  out.step = tensors[0].step;
  out.update_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  return out;
}

absl::Status StepExecutor::WriteWeights(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        uint32_t tensor) {
  return WriteWeightsRange(shard, bindings, tensor, 0, shard.tensors()[tensor].numel);
}

absl::Status StepExecutor::WriteWeightsRange(const ShardState& shard,
                                             std::span<const TensorBinding> bindings,
                                             uint32_t tensor, uint64_t offset, uint64_t count) {
  const TensorInfo& t = shard.tensors()[tensor];
  std::vector<float> master(count);
  shard.ReadTensorRange(tensor, 0, offset, count, master.data());
  const bool device = bindings[tensor].device;
  if (device && gpu_ == nullptr) {
    return absl::FailedPreconditionError("the tensor is in GPU memory but there is no GPU engine");
  }
  const uint64_t esize = DTypeSize(t.param_dtype);
  std::vector<char> staging;
  char* param = static_cast<char*>(bindings[tensor].param) + offset * esize;
  char* out = param;
  if (device) {
    staging.resize(count * esize);
    out = staging.data();
  }
  // Chunks in parallel: a 6B-parameter shard converts 6e9 elements at
  // registration and after every state load.
  tbb::parallel_for(tbb::blocked_range<uint64_t>(0, count, uint64_t{1} << 20),
                    [&](const tbb::blocked_range<uint64_t>& r) {
    for (uint64_t i = r.begin(); i < r.end(); ++i) {
      switch (t.param_dtype) {
        case DType::kF32: reinterpret_cast<float*>(out)[i] = master[i]; break;
        case DType::kBF16: reinterpret_cast<uint16_t*>(out)[i] = FloatToBF16(master[i]); break;
        case DType::kF16: reinterpret_cast<uint16_t*>(out)[i] = FloatToF16(master[i]); break;
      }
    }
  });
  if (device) return gpu_->CopyToDevice(param, staging.data(), staging.size());
  return absl::OkStatus();
}

absl::Status StepExecutor::ReadWeights(ShardState& shard, std::span<const TensorBinding> bindings,
                                       uint32_t tensor) {
  const TensorInfo& t = shard.tensors()[tensor];
  const bool device = bindings[tensor].device;
  if (device && gpu_ == nullptr) {
    return absl::FailedPreconditionError("the tensor is in GPU memory but there is no GPU engine");
  }
  // Converted straight into the masters' runs, in parallel. Device weights
  // are first copied into the run's exp_avg (still all zeros, and
  // page-locked when the engine pinned the shard first, so the copy runs at
  // PCIe speed; a 16-bit run needs half its room), converted from there, and
  // the exp_avg bytes zeroed again.
  constexpr uint64_t kBlock = uint64_t{1} << 20;  // elements per parallel task
  const std::vector<ShardState::MasterRun> runs = shard.MasterRuns(tensor);
  const size_t esize = DTypeSize(t.param_dtype);
  const char* base = static_cast<const char*>(bindings[tensor].param);
  if (device) {
    for (const ShardState::MasterRun& r : runs) {
      DOS_RETURN_IF_ERROR(
          gpu_->CopyToHost(r.exp_avg, base + r.tensor_offset * esize, r.count * esize));
    }
  }
  struct Piece {
    float* dst;
    const char* src;
    uint64_t count;
  };
  std::vector<Piece> pieces;
  for (const ShardState::MasterRun& r : runs) {
    const char* src = device ? reinterpret_cast<const char*>(r.exp_avg)
                             : base + r.tensor_offset * esize;
    for (uint64_t e = 0; e < r.count; e += kBlock) {
      pieces.push_back({r.master + e, src + e * esize, std::min(kBlock, r.count - e)});
    }
  }
  const DType dtype = t.param_dtype;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, pieces.size(), 1),
                    [&](const tbb::blocked_range<size_t>& range) {
    for (size_t i = range.begin(); i != range.end(); ++i) {
      const Piece& p = pieces[i];
      for (uint64_t e = 0; e < p.count; ++e) {
        uint16_t h;
        switch (dtype) {
          case DType::kF32: std::memcpy(&p.dst[e], p.src + 4 * e, 4); break;
          case DType::kBF16: std::memcpy(&h, p.src + 2 * e, 2); p.dst[e] = BF16ToFloat(h); break;
          case DType::kF16: std::memcpy(&h, p.src + 2 * e, 2); p.dst[e] = F16ToFloat(h); break;
        }
      }
      // The staging bytes were exp_avg: zero again (its pieces are disjoint).
      if (device) std::memset(const_cast<char*>(p.src), 0, p.count * esize);
    }
  });
  return absl::OkStatus();
}

}  // namespace dos
