// ExecutorSet: one executor per GPU engine plus the host one; a device UUID
// picks its engine's executor.
#include "daemon/sched/executor_set.h"

#include <gtest/gtest.h>

#include <string>

#include "daemon/cpu/host_engine.h"
#include "tests/unit/sched/fake_engine.h"

namespace dos {
namespace {

cpu::CpuUpdaterOptions OneThread() {
  cpu::CpuUpdaterOptions o;
  o.threads = 1;
  return o;
}

TEST(ExecutorSetTest, PicksTheExecutorOfEachDevice) {
  cpu::CpuUpdater cpu(OneThread());
  cpu::HostEngine host(&cpu);
  ExecutorSet set(&host);
  EXPECT_FALSE(set.has_gpu());
  ASSERT_NE(set.host(), nullptr);
  EXPECT_FALSE(set.host()->engine()->has_gpu());
  EXPECT_EQ(set.host()->engine()->name(), "host");
  FakeEngine gpu0(FakeEngine::Options{.gpu = true}), gpu3(FakeEngine::Options{.gpu = true});
  set.AddGpu({0, "GPU-00000000-0000-0000-0000-000000000000", "a"}, &gpu0);
  set.AddGpu({3, "GPU-33333333-3333-3333-3333-333333333333", "b"}, &gpu3);
  EXPECT_TRUE(set.has_gpu());
  ASSERT_EQ(set.devices().size(), 2u);
  absl::StatusOr<ExecutorSet::Device> e0 =
      set.ForDeviceUuid("GPU-00000000-0000-0000-0000-000000000000", "t");
  absl::StatusOr<ExecutorSet::Device> e3 = set.ForDeviceUuid(std::string(16, '\x33'), "t");
  ASSERT_TRUE(e0.ok()) << e0.status();
  ASSERT_TRUE(e3.ok()) << e3.status();
  EXPECT_EQ(e0->device.ordinal, 0);
  EXPECT_EQ(e3->device.ordinal, 3);
  EXPECT_EQ(e3->device.name, "b");
  EXPECT_NE(e0->executor, e3->executor);
  EXPECT_EQ(e3->executor->engine(), &gpu3);
  EXPECT_TRUE(e3->executor->planner().budgets().gpu);  // its planner may use the GPU
  EXPECT_FALSE(set.host()->planner().budgets().gpu);
  EXPECT_NE(e0->executor, set.host());
  EXPECT_NE(e3->executor, set.host());
  // The same device always gets the same executor.
  EXPECT_EQ(set.ForDeviceUuid("GPU-33333333-3333-3333-3333-333333333333", "t")->executor,
            e3->executor);
  EXPECT_EQ(set.ForDeviceUuid("GPU-44444444-4444-4444-4444-444444444444", "t").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace dos
