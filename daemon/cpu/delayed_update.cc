#include "daemon/cpu/delayed_update.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/cpu/subgroup_spans.h"
#include "dos/wire/status_macros.h"
#include "oneapi/tbb/parallel_for.h"

namespace dos::cpu {

absl::Status UpdateDelayed(CpuUpdater* cpu, ShardState& shard, const DelayedHost& delayed,
                           double* kernel_us) {
  std::span<const TensorDesc> tensors = shard.tensors();
  if (delayed.scalars().size() != tensors.size()) {
    return absl::InternalError(absl::StrCat("delayed update: ", delayed.scalars().size(),
                                            " scalars for ", tensors.size(), " tensors"));
  }
  // Subgroup by subgroup, in capture order: each waits for its own
  // gradients only (DelayedHost::await_capture), so that the update runs
  // beside the copies of the later ones.
  std::vector<CpuUpdater::Item> items;
  for (uint32_t sg : delayed.captured()) {
    if (sg >= shard.subgroups().size()) {
      return absl::InternalError(absl::StrCat("delayed update: subgroup ", sg, " of ",
                                              shard.subgroups().size()));
    }
    if (delayed.updates_on_gpu(sg)) continue;  // the GPU engine's (GpuEngine::UpdateDelayed)
    const Subgroup& g = shard.subgroups()[sg];
    items.clear();
    absl::Status st = ForEachSegmentSpan(
        tensors, g, g.master,
        [&](const SubgroupSegment& seg, const TensorDesc& t) {
          return SegmentIo{delayed.grad(sg, seg), t.grad_dtype, delayed.weight(sg, seg),
                           t.param_dtype};
        },
        [&](const SubgroupSegment& seg, const AdamSpan& span) {
          items.push_back({delayed.scalars_for(sg)[seg.tensor], span});
          return absl::OkStatus();
        });
    if (!st.ok()) return st;
    if (delayed.await_capture) DOS_RETURN_IF_ERROR(delayed.await_capture(sg));
    shard.BeforeWrite(sg);  // checkpoint copy-on-write: the kernel writes it
    const absl::Time t0 = absl::Now();
    cpu->Run(items);
    *kernel_us += absl::ToDoubleMicroseconds(absl::Now() - t0);
    delayed.MarkUpdated(sg);  // a hand-off's next step may take it now
  }
  return absl::OkStatus();
}

absl::Status CopyDelayedHost(const ShardState& shard, std::span<const TensorBinding> bindings,
                             const DelayedHost& delayed, std::span<const uint32_t> subgroups,
                             bool capture) {
  std::span<const TensorDesc> tensors = shard.tensors();
  tbb::parallel_for(size_t{0}, subgroups.size(), [&](size_t i) {
    const uint32_t sg = subgroups[i];
    const Subgroup& g = shard.subgroups()[sg];
    const bool install = !capture || delayed.installs(sg);
    const bool grads = capture && !delayed.captured_early(sg);
    for (const SubgroupSegment& seg : g.segments) {
      const TensorDesc& t = tensors[seg.tensor];
      if (install) {
        std::memcpy(ElementAt(bindings[seg.tensor].param, t.param_dtype, seg.tensor_offset),
                    delayed.weight(sg, seg), seg.count * DTypeSize(t.param_dtype));
      }
      if (grads) {
        std::memcpy(delayed.grad(sg, seg),
                    ElementAt(bindings[seg.tensor].grad, t.grad_dtype, seg.tensor_offset),
                    seg.count * DTypeSize(t.grad_dtype));
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace dos::cpu
