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

}  // namespace
}  // namespace dos
