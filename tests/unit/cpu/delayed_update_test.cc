// cpu::UpdateDelayed beside an engine whose captures may still be copying
// (DelayedHost::await_capture, GpuEngine::CaptureLoop): each subgroup the
// CPU updates waits for its own gradients, in capture order, right before
// its kernel, so the update runs beside the copies of the later ones; the
// GPU's share waits for nothing here; a failed wait ends the update there,
// with its error, and leaves the later subgroups as they were.
#include "daemon/cpu/delayed_update.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "daemon/cpu/adam_kernel.h"
#include "daemon/cpu/cpu_updater.h"

namespace dos::cpu {
namespace {

constexpr uint64_t kSubgroup = 1000;

float FirstWeight(const DelayedHost& delayed, const ShardState& shard, uint32_t sg) {
  float w;
  std::memcpy(&w, delayed.weight(sg, shard.subgroups()[sg].segments[0]), sizeof(w));
  return w;
}

TEST(DelayedUpdateTest, EachSubgroupWaitsForItsOwnCaptureInCaptureOrder) {
  HostMemoryBudget budget{0};
  std::vector<TensorDesc> tensors(1);
  tensors[0].numel = 4 * kSubgroup;  // fp32 weights and gradients
  auto shard = *ShardState::Create(tensors, {GroupConfig{}}, kSubgroup, &budget, "test");
  DelayedHost delayed(*shard, &budget);
  const std::vector<uint32_t> order = {3, 0, 1, 2}, on_gpu = {1};
  ASSERT_TRUE(delayed
                  .Place(order,
                         [](uint64_t bytes) -> absl::StatusOr<HostBuffer> {
                           return HostBuffer(new char[bytes], [](char* p) { delete[] p; });
                         })
                  .ok());
  const GroupStepParams params{
      .lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0};
  delayed.BeginCapture(order, {MakeAdamScalars(params, true, 1, 1.0, 1.0)}, on_gpu);
  const std::vector<float> grads(kSubgroup, 1.0f), sentinel(kSubgroup, 7.0f);
  for (uint32_t sg : order) {
    const SubgroupSegment& seg = shard->subgroups()[sg].segments[0];
    std::memcpy(delayed.grad(sg, seg), grads.data(), kSubgroup * sizeof(float));
    std::memcpy(delayed.weight(sg, seg), sentinel.data(), kSubgroup * sizeof(float));
  }
  std::vector<uint32_t> waited;
  std::vector<float> weight_when_waited;
  delayed.await_capture = [&](uint32_t sg) {
    waited.push_back(sg);
    weight_when_waited.push_back(FirstWeight(delayed, *shard, sg));
    return sg == 2 ? absl::UnavailableError("fake: the copy failed") : absl::OkStatus();
  };
  CpuUpdater cpu({.threads = 2, .tile_elems = 256});
  double kernel_us = 0;
  const absl::Status st = UpdateDelayed(&cpu, *shard, delayed, &kernel_us);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(waited, (std::vector<uint32_t>{3, 0, 2}));           // 1 is the GPU's
  EXPECT_EQ(weight_when_waited, (std::vector<float>(3, 7.0f)));  // each before its kernel
  EXPECT_NE(FirstWeight(delayed, *shard, 3), 7.0f);              // updated: Adam's first step
  EXPECT_NE(FirstWeight(delayed, *shard, 0), 7.0f);
  EXPECT_EQ(FirstWeight(delayed, *shard, 2), 7.0f);  // its gradients never came
  EXPECT_EQ(FirstWeight(delayed, *shard, 1), 7.0f);  // the GPU engine's
  EXPECT_GT(kernel_us, 0);
}

}  // namespace
}  // namespace dos::cpu
