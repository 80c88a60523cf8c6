// EngineSessions: which sessions take turns on an engine. A bound session
// shares the engine with every other bound one; one that steps with a lease
// counts too; one whose trainer died (Unbind) counts for neither but keeps
// its resident share until Forget. (The shares themselves:
// resident_tier_test.cc.)
#include "daemon/sched/engine_sessions.h"

#include <gtest/gtest.h>

namespace dos {
namespace {

ShardLayout Uniform(uint32_t n) {
  ShardLayout l;
  l.subgroup_numel.assign(n, 1000);
  return l;
}

PlanBudgets Gpu(uint64_t cap = 0) {
  PlanBudgets b;
  b.gpu = true;
  b.gpu_resident_bytes = cap;
  return b;
}

TEST(EngineSessionsTest, BoundSessionsShareTheEngine) {
  EngineSessions s(Gpu(), false);
  EXPECT_TRUE(s.Alone());
  EXPECT_FALSE(s.Shared(1));
  s.Bind(1);
  EXPECT_TRUE(s.Alone());
  EXPECT_FALSE(s.Shared(1));
  EXPECT_TRUE(s.Shared(2));  // a session not bound yet would share it with 1
  s.Bind(2);
  EXPECT_FALSE(s.Alone());
  EXPECT_TRUE(s.Shared(1));
  EXPECT_TRUE(s.Shared(2));
  s.Forget(2);
  EXPECT_TRUE(s.Alone());
  EXPECT_FALSE(s.Shared(1));
}

TEST(EngineSessionsTest, ASessionSteppingWithALeaseCountsBoundOrNot) {
  EngineSessions s(Gpu(), false);
  s.SetLease(1, GpuLease{}, Uniform(4));
  EXPECT_TRUE(s.Alone());
  s.SetLease(2, GpuLease{}, Uniform(4));
  EXPECT_FALSE(s.Alone());
  s.Forget(2);
  EXPECT_TRUE(s.Alone());
}

TEST(EngineSessionsTest, ADeadTrainersSessionTakesNoTurnsButKeepsItsShare) {
  const uint64_t sg_bytes = 1000 * 12;
  EngineSessions s(Gpu(/*cap=*/4 * sg_bytes), false);
  const GpuLease lease{.reported = true, .lease_bytes = s.StagingBytes(Uniform(8)) + 4 * sg_bytes};
  for (uint64_t id : {1, 2}) {
    s.Bind(id);
    s.SetLease(id, lease, Uniform(8));
  }
  EXPECT_FALSE(s.Alone());
  EXPECT_EQ(s.ResidentBytes(1), 2 * sg_bytes);  // the cap, halved
  s.Unbind(2);
  EXPECT_TRUE(s.Alone());
  EXPECT_FALSE(s.Shared(1));
  // Its resident state is still on the GPU: the cap stays shared with it.
  EXPECT_EQ(s.ResidentBytes(1), 2 * sg_bytes);
  EXPECT_EQ(s.ResidentBytes(2), 2 * sg_bytes);
  EXPECT_TRUE(s.LeaseOf(2).reported);
  s.Forget(2);  // resumed elsewhere, or its lease ended
  EXPECT_EQ(s.ResidentBytes(1), 4 * sg_bytes);
  EXPECT_EQ(s.ResidentBytes(2), 0u);
  EXPECT_FALSE(s.LeaseOf(2).reported);
}

// The staging a lease pays for first: the slots' state, and with staging_io
// (--delayed_gpu_staged) a delayed update's gradients and weights too.
TEST(EngineSessionsTest, StagedDelayedIoIsChargedToTheStaging) {
  PlanBudgets budgets = Gpu();
  budgets.staging_slots = 3;
  EXPECT_EQ(EngineSessions(budgets, false).StagingBytes(Uniform(5)), 3u * 1000 * 12);
  EXPECT_EQ(EngineSessions(budgets, true).StagingBytes(Uniform(5)), 3u * 1000 * 12 + 2 * 1000 * 4);
  budgets.staging_io = true;
  EngineSessions staged(budgets, false);
  EXPECT_EQ(staged.StagingBytes(Uniform(5)), 3u * 1000 * (12 + kStagedIoBytesPerParam));
  // A lease that covered the slots without it leaves less for resident state.
  const GpuLease lease{.reported = true, .lease_bytes = 3u * 1000 * 12 + 4 * 12'000};
  staged.SetLease(1, lease, Uniform(5));
  EXPECT_EQ(staged.ResidentBytes(1), 4u * 12'000 - 3 * 1000 * kStagedIoBytesPerParam);
}

}  // namespace
}  // namespace dos
