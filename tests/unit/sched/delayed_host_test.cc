// DelayedHost's buffers against the HostMemoryBudget of its shard's state:
// each region is charged from its allocation until it is freed; Place
// charges the regions it needs all at once, so a placement past the limit
// allocates nothing, and one whose allocation fails gives back the charge
// of the regions it did not make; a subgroup's region holds each segment at
// its offset.
#include "daemon/sched/delayed_host.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dos {
namespace {

constexpr uint64_t kSubgroup = 1000;
constexpr uint64_t kRegionBytes = kSubgroup * (4 + 4);  // fp32 gradients and weights

// An engine's AllocStaging: plain host memory; fails from call `fail_at` on.
struct CountingAlloc {
  int calls = 0;
  int fail_at = 1 << 30;
  AllocHostBuffer Fn() {
    return [this](uint64_t bytes) -> absl::StatusOr<HostBuffer> {
      if (calls++ >= fail_at) return absl::ResourceExhaustedError("fake: no host memory");
      return HostBuffer(new char[bytes], [](char* p) { delete[] p; });
    };
  }
};

std::unique_ptr<ShardState> FourSubgroups(HostMemoryBudget* budget) {
  std::vector<TensorDesc> tensors(1);
  tensors[0].numel = 4 * kSubgroup;
  return *ShardState::Create(tensors, {GroupConfig{}}, kSubgroup, budget, "test");
}

TEST(DelayedHostTest, RegionsAreChargedUntilFreed) {
  HostMemoryBudget budget{0};
  auto shard = FourSubgroups(&budget);
  const uint64_t state = budget.used();
  CountingAlloc alloc;
  {
    DelayedHost delayed(*shard, &budget);
    const std::vector<uint32_t> first = {3, 2}, second = {3, 2, 1};
    ASSERT_TRUE(delayed.Place(first, alloc.Fn()).ok());
    EXPECT_EQ(budget.used(), state + 2 * kRegionBytes);
    EXPECT_EQ(delayed.bytes(), 2 * kRegionBytes);
    ASSERT_TRUE(delayed.Place(second, alloc.Fn()).ok());  // one more
    ASSERT_TRUE(delayed.Place(first, alloc.Fn()).ok());   // reused
    EXPECT_EQ(alloc.calls, 3);
    EXPECT_EQ(budget.used(), state + 3 * kRegionBytes);
  }
  EXPECT_EQ(budget.used(), state);
}

// A subgroup's gradients and weights lie in its region whole, each segment
// at its subgroup offset of the widest dtype: what one copy of the region
// moves (the GPU's staged delayed update) is what grad() and weight() name.
TEST(DelayedHostTest, ASubgroupsRegionHoldsEachSegmentAtItsOffset) {
  std::vector<TensorDesc> tensors(2);
  tensors[0].numel = 1500;
  tensors[0].grad_dtype = DType::kBF16;
  tensors[0].param_dtype = DType::kBF16;
  tensors[1].numel = 1300;
  tensors[1].grad_dtype = DType::kF32;
  tensors[1].param_dtype = DType::kF16;
  HostMemoryBudget budget{0};
  auto shard = *ShardState::Create(tensors, {GroupConfig{}}, kSubgroup, &budget, "test");
  DelayedHost delayed(*shard, &budget);
  std::vector<uint32_t> all;
  for (uint32_t i = 0; i < shard->subgroups().size(); ++i) all.push_back(i);
  CountingAlloc alloc;
  ASSERT_TRUE(delayed.Place(all, alloc.Fn()).ok());
  EXPECT_EQ(delayed.grad_elem(), 4u);
  EXPECT_EQ(delayed.weight_elem(), 2u);
  for (uint32_t sg : all) {
    const Subgroup& g = shard->subgroups()[sg];
    EXPECT_GE(delayed.weight_region(sg) - delayed.grad_region(sg),
              static_cast<std::ptrdiff_t>(g.numel * delayed.grad_elem()));
    for (const SubgroupSegment& seg : g.segments) {
      EXPECT_EQ(delayed.grad(sg, seg), delayed.grad_region(sg) + seg.subgroup_offset * 4);
      EXPECT_EQ(delayed.weight(sg, seg), delayed.weight_region(sg) + seg.subgroup_offset * 2);
      EXPECT_LE(seg.subgroup_offset + seg.count, g.numel);
    }
  }
}

TEST(DelayedHostTest, APlacementPastTheLimitAllocatesNothing) {
  HostMemoryBudget budget{4 * 12288 + kRegionBytes + kRegionBytes / 2};  // state + 1.5 regions
  auto shard = FourSubgroups(&budget);
  const uint64_t state = budget.used();
  ASSERT_EQ(state, 4u * 12288);
  CountingAlloc alloc;
  DelayedHost delayed(*shard, &budget);
  const std::vector<uint32_t> two = {3, 2}, one = {3};
  absl::Status st = delayed.Place(two, alloc.Fn());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(st.message());
  EXPECT_NE(msg.find("needs 15.62 KiB (16000 bytes) of host memory for the delayed update's "
                     "capture buffers (2 more"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("raise dosd --host_memory_limit"), std::string::npos) << msg;
  EXPECT_EQ(alloc.calls, 0);
  EXPECT_EQ(budget.used(), state);
  EXPECT_EQ(delayed.bytes(), 0u);
  // Within the limit it places.
  ASSERT_TRUE(delayed.Place(one, alloc.Fn()).ok());
  EXPECT_EQ(budget.used(), state + kRegionBytes);
}

TEST(DelayedHostTest, AFailedAllocationGivesBackTheRegionsNotMade) {
  HostMemoryBudget budget{0};
  auto shard = FourSubgroups(&budget);
  const uint64_t state = budget.used();
  CountingAlloc alloc{.fail_at = 1};
  DelayedHost delayed(*shard, &budget);
  const std::vector<uint32_t> three = {3, 2, 1};
  absl::Status st = delayed.Place(three, alloc.Fn());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("fake: no host memory"), absl::string_view::npos) << st;
  // The one region made stays in the pool, charged; the two others are not.
  EXPECT_EQ(delayed.bytes(), kRegionBytes);
  EXPECT_EQ(budget.used(), state + kRegionBytes);
  alloc.fail_at = 1 << 30;
  ASSERT_TRUE(delayed.Place(three, alloc.Fn()).ok());
  EXPECT_EQ(budget.used(), state + 3 * kRegionBytes);
}


// --session_memory_limit covers the session's state and its buffers
// together: a placement past it allocates nothing and says so.
TEST(DelayedHostTest, APlacementPastTheSessionLimitAllocatesNothing) {
  HostMemoryBudget budget{0};
  auto shard = FourSubgroups(&budget);
  const uint64_t state = budget.used();
  CountingAlloc alloc;
  DelayedHost delayed(*shard, &budget, state + kRegionBytes + kRegionBytes / 2);
  const std::vector<uint32_t> two = {3, 2}, one = {3};
  absl::Status st = delayed.Place(two, alloc.Fn());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("--session_memory_limit"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("delay=0"), absl::string_view::npos) << st;
  EXPECT_EQ(alloc.calls, 0);
  EXPECT_EQ(budget.used(), state);
  ASSERT_TRUE(delayed.Place(one, alloc.Fn()).ok());
  EXPECT_EQ(budget.used(), state + kRegionBytes);
}

// A step's captures name the subgroups the GPU updates in the window
// (--delayed_gpu_path) until their update is done.
TEST(DelayedHostTest, CapturesNameTheSubgroupsUpdatedOnTheGpu) {
  HostMemoryBudget budget{0};
  auto shard = FourSubgroups(&budget);
  DelayedHost delayed(*shard, &budget);
  CountingAlloc alloc;
  const std::vector<uint32_t> all = {0, 1, 2, 3}, on_gpu = {1, 3};
  ASSERT_TRUE(delayed.Place(all, alloc.Fn()).ok());
  delayed.BeginCapture(all, std::vector<cpu::AdamScalars>(1), on_gpu);
  EXPECT_TRUE(delayed.any_on_gpu());
  EXPECT_FALSE(delayed.updates_on_gpu(0));
  EXPECT_TRUE(delayed.updates_on_gpu(1));
  EXPECT_TRUE(delayed.updates_on_gpu(3));
  EXPECT_FALSE(delayed.updates_on_gpu(7));  // out of range: no
  delayed.Updated();
  EXPECT_FALSE(delayed.any_on_gpu());
  EXPECT_FALSE(delayed.updates_on_gpu(1));
  EXPECT_EQ(delayed.pending().size(), 4u);
  delayed.BeginCapture(all, std::vector<cpu::AdamScalars>(1));  // the CPU's alone
  EXPECT_FALSE(delayed.any_on_gpu());
}

// The window a plan budgets is the trainer's own (measured with no delayed
// update beside it), not one the update stretched: on nvidia-h200 the HF
// Trainer's 7B fp32 window grew from 0.25 to 0.6 s beside a 0.68 s update,
// and a budget taken from it delayed more (26 subgroups, 0.93 s/iter).
TEST(DelayedHostTest, PlansBudgetTheWindowNoUpdateStretched) {
  HostMemoryBudget budget{0};
  auto shard = FourSubgroups(&budget);
  DelayedHost delayed(*shard, &budget);
  EXPECT_DOUBLE_EQ(delayed.PlanWindowUs(), 0);
  delayed.NoteWindowSample(250);  // after an exact step: clean
  EXPECT_DOUBLE_EQ(delayed.clean_window_us, 250);
  delayed.window_loaded = true;  // a delayed update runs beside the next ones
  delayed.NoteWindowSample(600);
  delayed.NoteWindowSample(600);
  EXPECT_DOUBLE_EQ(delayed.window_us, 512.5);
  EXPECT_DOUBLE_EQ(delayed.clean_window_us, 250);
  EXPECT_DOUBLE_EQ(delayed.PlanWindowUs(), 250);
  // A trainer that got faster is believed at once; a clean window of a
  // slower trainer is taken too.
  delayed.NoteWindowSample(100);
  delayed.NoteWindowSample(100);
  delayed.NoteWindowSample(0);  // no sample
  EXPECT_DOUBLE_EQ(delayed.PlanWindowUs(), delayed.window_us);
  EXPECT_LT(delayed.window_us, 250);
  delayed.window_loaded = false;
  delayed.NoteWindowSample(400);
  EXPECT_DOUBLE_EQ(delayed.clean_window_us, 325);
}

}  // namespace
}  // namespace dos
