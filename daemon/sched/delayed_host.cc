#include "daemon/sched/delayed_host.h"

#include <time.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

// Per subgroup of `n`: whether it is one of `subgroups`.
std::vector<bool> MaskOf(size_t n, std::span<const uint32_t> subgroups) {
  std::vector<bool> mask(n, false);
  for (uint32_t sg : subgroups) mask[sg] = true;
  return mask;
}

}  // namespace

uint64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

DelayedHost::DelayedHost(const ShardState& shard, HostMemoryBudget* budget,
                         uint64_t session_limit)
    : budget_(budget),
      session_limit_(session_limit),
      state_bytes_(ShardState::AllocatedBytes(shard.total_params(), shard.subgroup_size(),
                                              shard.format())) {
  for (const TensorDesc& t : shard.tensors()) {
    grad_elem_ = std::max<uint64_t>(grad_elem_, DTypeSize(t.grad_dtype));
    weight_elem_ = std::max<uint64_t>(weight_elem_, DTypeSize(t.param_dtype));
  }
  for (const Subgroup& g : shard.subgroups()) max_numel_ = std::max(max_numel_, g.numel);
  region_bytes_ = max_numel_ * (grad_elem_ + weight_elem_);
  region_of_.assign(shard.subgroups().size(), -1);
  // At most one region a subgroup: Grow never moves the vector, which an
  // update in flight reads (a hand-off's Place grows it beside that update).
  regions_.reserve(shard.subgroups().size());
  state_.assign(shard.subgroups().size(), kNone);
  early_ = std::make_unique<std::atomic<bool>[]>(shard.subgroups().size());
  updated_ = std::make_unique<std::atomic<bool>[]>(shard.subgroups().size());
  for (size_t sg = 0; sg < state_.size(); ++sg) updated_[sg].store(false);
  DropEarly();
}

absl::Status DelayedHost::Place(std::span<const uint32_t> subgroups,
                                const AllocHostBuffer& alloc) {
  const std::vector<bool> wanted = MaskOf(region_of_.size(), subgroups);
  // Regions of subgroups that left the set and wait for nothing go back.
  for (uint32_t sg = 0; sg < region_of_.size(); ++sg) {
    if (region_of_[sg] >= 0 && !wanted[sg] && state_[sg] == kNone) {
      free_.push_back(static_cast<uint32_t>(region_of_[sg]));
      region_of_[sg] = -1;
    }
  }
  uint64_t homeless = 0;
  for (uint32_t sg : subgroups) homeless += region_of_[sg] < 0 ? 1 : 0;
  if (homeless > free_.size()) DOS_RETURN_IF_ERROR(Grow(homeless - free_.size(), alloc));
  for (uint32_t sg : subgroups) {
    if (region_of_[sg] >= 0) continue;
    region_of_[sg] = static_cast<int32_t>(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

absl::Status DelayedHost::Grow(uint64_t count, const AllocHostBuffer& alloc) {
  // Charged at once: a step refused here holds no more than before it.
  const uint64_t n = region_bytes_;
  const uint64_t after = state_bytes_ + (regions_.size() + count) * n;
  if (session_limit_ != 0 && after > session_limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this delayed step needs ", FormatBytes(count * n), " more host memory for the delayed "
        "update's capture buffers (", count, " more, one per delayed subgroup, ",
        regions_.size(), " held already); with the session's optimizer state (",
        FormatBytes(state_bytes_), ") that is ", FormatBytes(after), ", past dosd's "
        "--session_memory_limit of ", FormatBytes(session_limit_), ". Raise the limit, or run "
        "without delay (dos.torch: delay=0), which needs no such buffers; this step applied "
        "nothing"));
  }
  if (budget_ != nullptr) {
    DOS_RETURN_IF_ERROR(budget_->Reserve(
        count * n, "this delayed step",
        absl::StrCat("host memory for the delayed update's capture buffers (", count,
                     " more, ", FormatBytes(n), " each, one per delayed subgroup for its "
                     "gradients and new weights; ", regions_.size(), " held already)"),
        "raise dosd --host_memory_limit, or run without delay (dos.torch: delay=0), which "
        "needs no such buffers; this step applied nothing"));
  }
  for (uint64_t i = 0; i < count; ++i) {
    absl::StatusOr<HostBuffer> buf = alloc(n);
    if (!buf.ok()) {
      if (budget_ != nullptr) budget_->Release((count - i) * n);  // the regions not made
      return absl::ResourceExhaustedError(absl::StrCat(
          "the delayed host path needs ", n, " more bytes of host memory for a "
          "subgroup's gradients and weights (", regions_.size(), " regions held): ",
          buf.status().message(), "; run without delay (dos.torch: delay=0) or free host memory"));
    }
    free_.push_back(static_cast<uint32_t>(regions_.size()));
    regions_.push_back(budget_ != nullptr ? Charged(*std::move(buf)) : *std::move(buf));
  }
  return absl::OkStatus();
}

HostBuffer DelayedHost::Charged(HostBuffer buf) const {
  // The region's charge goes back with its memory, whoever frees it.
  auto engine_free = std::move(buf.get_deleter());
  char* const region = buf.release();
  return HostBuffer(region, [engine_free = std::move(engine_free), budget = budget_,
                             n = region_bytes_](char* p) {
    engine_free(p);
    budget->Release(n);
  });
}

char* DelayedHost::grad(uint32_t sg, const SubgroupSegment& seg) const {
  return regions_[region_of_[sg]].get() + seg.subgroup_offset * grad_elem_;
}

char* DelayedHost::grad_region(uint32_t sg) const { return regions_[region_of_[sg]].get(); }

char* DelayedHost::weight_region(uint32_t sg) const {
  return regions_[region_of_[sg]].get() + max_numel_ * grad_elem_;
}

char* DelayedHost::weight(uint32_t sg, const SubgroupSegment& seg) const {
  return regions_[region_of_[sg]].get() + max_numel_ * grad_elem_ +
         seg.subgroup_offset * weight_elem_;
}

void DelayedHost::BeginCapture(std::span<const uint32_t> subgroups,
                               std::vector<cpu::AdamScalars> scalars,
                               std::span<const uint32_t> on_gpu) {
  await_capture = nullptr;
  on_gpu_.assign(state_.size(), false);
  for (uint32_t sg : on_gpu) on_gpu_[sg] = true;
  installs_.assign(state_.size(), false);
  for (uint32_t sg : subgroups) installs_[sg] = state_[sg] == kPending;
  Installed(subgroups);  // the step installs the pending ones among them first
  captured_.assign(subgroups.begin(), subgroups.end());
  for (uint32_t sg : captured_) {
    state_[sg] = kCaptured;
    updated_[sg].store(false, std::memory_order_relaxed);
  }
  finished_.store(false, std::memory_order_relaxed);
  scalars_ = std::move(scalars);
  scaled_scalars_.clear();
  scaled_.assign(state_.size(), false);
  if (early_coef_ != 1.0f) {
    // round_to(grad dtype, float(g) * c): the trainer's multiply, bit for bit.
    scaled_scalars_ = scalars_;
    for (cpu::AdamScalars& s : scaled_scalars_) s.grad_coef = early_coef_;
    for (uint32_t sg : captured_) scaled_[sg] = captured_early(sg);
  }
}

void DelayedHost::BeginEarly(std::span<const uint32_t> subgroups) {
  installs_.assign(state_.size(), false);
  for (uint32_t sg : subgroups) installs_[sg] = installable(sg);
}

void DelayedHost::EarlyCaptured(std::span<const uint32_t> subgroups) {
  Installed(subgroups);
  for (uint32_t sg : subgroups) early_[sg].store(true, std::memory_order_release);
  installs_.clear();
}

void DelayedHost::DropEarly() {
  // Not scaled_scalars_ or scaled_: an update in flight reads them.
  for (size_t sg = 0; sg < state_.size(); ++sg) early_[sg].store(false, std::memory_order_relaxed);
  early_coef_ = 1.0f;
}

void DelayedHost::Updated(bool keep_early) {
  if (!keep_early) DropEarly();
  await_capture = nullptr;
  for (uint32_t sg : captured_) {
    updated_[sg].store(false, std::memory_order_relaxed);
    if (state_[sg] == kInstalled) {
      state_[sg] = kNone;  // the next step's early captures installed it
      continue;
    }
    state_[sg] = kPending;
    pending_.push_back(sg);
  }
  captured_.clear();
  scalars_.clear();
  scaled_scalars_.clear();
  scaled_.clear();
  installs_.clear();
  on_gpu_.clear();
}

bool DelayedHost::UpdateStaysIn(std::span<const uint32_t> keep) const {
  const std::vector<bool> kept = MaskOf(state_.size(), keep);
  return std::all_of(captured_.begin(), captured_.end(), [&](uint32_t sg) { return kept[sg]; });
}

bool DelayedHost::UpdateAbove(uint32_t resident) const {
  return std::all_of(captured_.begin(), captured_.end(),
                     [resident](uint32_t sg) { return sg >= resident; });
}

std::vector<uint32_t> DelayedHost::PendingExcept(std::span<const uint32_t> keep) const {
  const std::vector<bool> kept = MaskOf(state_.size(), keep);
  std::vector<uint32_t> out;
  for (uint32_t sg : pending_) {
    if (!kept[sg]) out.push_back(sg);
  }
  return out;
}

void DelayedHost::Installed(std::span<const uint32_t> subgroups) {
  for (uint32_t sg : subgroups) {
    if (state_[sg] == kPending) state_[sg] = kNone;
    if (state_[sg] == kCaptured && updated_[sg].load(std::memory_order_acquire)) {
      state_[sg] = kInstalled;
    }
  }
  std::erase_if(pending_, [&](uint32_t sg) { return state_[sg] != kPending; });
}

void DelayedHost::NoteWindowSample(double sample_us) {
  if (sample_us <= 0) return;
  // Each figure is half its last value, half the sample (the sample alone at first).
  auto smooth = [sample_us](double& figure) {
    figure = figure > 0 ? 0.5 * figure + 0.5 * sample_us : sample_us;
  };
  smooth(window_us);
  if (!window_loaded) smooth(clean_window_us);
}

}  // namespace dos
