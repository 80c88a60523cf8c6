// SubgroupQueue: pinned lists in order, shared subgroups from opposite ends,
// the GPU side's predicate (and what the CPU still holds, which it sees),
// and concurrent claiming that hands out every subgroup exactly once.
#include "daemon/sched/subgroup_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace dos {
namespace {

auto Always() {
  return [](const SubgroupQueue::SharedClaim&) { return true; };
}

TEST(SubgroupQueueTest, PinnedSubgroupsComeInTheirOrder) {
  SubgroupQueue q({0, 2, 4}, {5, 3, 1}, {}, std::vector<uint64_t>(6, 10));
  EXPECT_EQ(q.ClaimGpu(Always()), 0u);
  EXPECT_EQ(q.ClaimCpu(), 5u);
  EXPECT_EQ(q.ClaimGpu(Always()), 2u);
  EXPECT_EQ(q.ClaimGpu(Always()), 4u);
  EXPECT_EQ(q.ClaimGpu(Always()), std::nullopt);
  EXPECT_FALSE(q.GpuMayHaveWork());
  EXPECT_EQ(q.ClaimCpu(), 3u);
  EXPECT_EQ(q.ClaimCpu(), 1u);
  EXPECT_EQ(q.ClaimCpu(), std::nullopt);
}

TEST(SubgroupQueueTest, SharedSubgroupsGoGpuFromTheFrontCpuFromTheBack) {
  SubgroupQueue q({}, {}, {0, 1, 2, 3}, std::vector<uint64_t>(4, 10));
  EXPECT_TRUE(q.GpuMayHaveWork());
  EXPECT_EQ(q.ClaimGpu(Always()), 0u);
  EXPECT_EQ(q.ClaimCpu(), 3u);
  EXPECT_EQ(q.ClaimCpu(), 2u);
  EXPECT_EQ(q.ClaimGpu(Always()), 1u);
  EXPECT_FALSE(q.GpuMayHaveWork());
  EXPECT_EQ(q.ClaimCpu(), std::nullopt);
}

TEST(SubgroupQueueTest, OwnSubgroupsBeforeSharedOnes) {
  SubgroupQueue q({7}, {6}, {0, 1}, std::vector<uint64_t>(8, 1));
  EXPECT_EQ(q.ClaimCpu(), 6u);
  EXPECT_EQ(q.ClaimCpu(), 1u);
  EXPECT_EQ(q.ClaimGpu(Always()), 7u);
  EXPECT_EQ(q.ClaimGpu(Always()), 0u);
}

TEST(SubgroupQueueTest, ThePredicateSeesTheNextSizeAndWhatIsLeftAndCanDecline) {
  SubgroupQueue q({}, {}, {0, 1, 2}, {100, 20, 3});
  std::vector<std::pair<uint64_t, uint64_t>> asked;
  auto record = [&](const SubgroupQueue::SharedClaim& c) {
    asked.emplace_back(c.numel, c.shared_left);
    return c.numel > 50;
  };
  EXPECT_EQ(q.ClaimGpu(record), 0u);
  EXPECT_EQ(q.ClaimGpu(record), std::nullopt);  // 20 <= 50: declined, left for the CPU
  EXPECT_TRUE(q.GpuMayHaveWork());
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[0], std::make_pair(uint64_t{100}, uint64_t{123}));
  EXPECT_EQ(asked[1], std::make_pair(uint64_t{20}, uint64_t{23}));
  EXPECT_EQ(q.ClaimCpu(), 2u);
  EXPECT_EQ(q.ClaimGpu(record), std::nullopt);
  ASSERT_EQ(asked.size(), 3u);
  EXPECT_EQ(asked[2], std::make_pair(uint64_t{20}, uint64_t{20}));
}

TEST(SubgroupQueueTest, ThePredicateSeesWhatTheCpuHoldsUntilItIsDone) {
  // Pinned to the CPU: 4 and 5 (1000 and 200); shared: 0..3.
  SubgroupQueue q({}, {4, 5}, {0, 1, 2, 3}, {10, 20, 30, 40, 1000, 200});
  uint64_t cpu_left = 0;
  auto record = [&](const SubgroupQueue::SharedClaim& c) {
    cpu_left = c.cpu_left;
    return false;
  };
  q.ClaimGpu(record);
  EXPECT_EQ(cpu_left, 1200u);  // its pinned ones, not yet claimed
  EXPECT_EQ(q.ClaimCpu(), 4u);
  EXPECT_EQ(q.ClaimCpu(), 5u);
  q.ClaimGpu(record);
  EXPECT_EQ(cpu_left, 1200u);  // claimed, still being updated
  q.CpuDone(4);
  q.ClaimGpu(record);
  EXPECT_EQ(cpu_left, 200u);
  EXPECT_EQ(q.ClaimCpu(), 3u);  // a shared one it claims counts from then on
  q.ClaimGpu(record);
  EXPECT_EQ(cpu_left, 240u);
  q.CpuDone(5);
  q.CpuDone(3);
  q.ClaimGpu(record);
  EXPECT_EQ(cpu_left, 0u);
}

TEST(SubgroupQueueTest, ThePredicateIsNotAskedForPinnedSubgroups) {
  SubgroupQueue q({3}, {}, {}, std::vector<uint64_t>(4, 1));
  EXPECT_EQ(q.ClaimGpu([](const SubgroupQueue::SharedClaim&) -> bool {
    ADD_FAILURE() << "asked";
    return false;
  }), 3u);
}

TEST(SubgroupQueueTest, AnEmptyQueueHasNothingForEitherSide) {
  SubgroupQueue q({}, {}, {}, {});
  EXPECT_FALSE(q.GpuMayHaveWork());
  EXPECT_EQ(q.ClaimGpu(Always()), std::nullopt);
  EXPECT_EQ(q.ClaimCpu(), std::nullopt);
}

TEST(SubgroupQueueTest, ConcurrentClaimsHandOutEverySubgroupOnce) {
  constexpr uint32_t kN = 2000;
  std::vector<uint32_t> gpu, cpu, shared;
  for (uint32_t i = 0; i < kN; ++i) (i % 5 == 0 ? gpu : i % 5 == 1 ? cpu : shared).push_back(i);
  SubgroupQueue q(gpu, cpu, shared, std::vector<uint64_t>(kN, 7));
  std::mutex mu;
  std::multiset<uint32_t> got;
  auto worker = [&](bool gpu_side) {
    std::vector<uint32_t> mine;
    for (;;) {
      std::optional<uint32_t> c = gpu_side ? q.ClaimGpu(Always()) : q.ClaimCpu();
      if (!c) break;
      mine.push_back(*c);
    }
    std::lock_guard<std::mutex> lock(mu);
    got.insert(mine.begin(), mine.end());
  };
  std::thread a(worker, true), b(worker, false), c(worker, false);
  a.join();
  b.join();
  c.join();
  ASSERT_EQ(got.size(), kN);
  for (uint32_t i = 0; i < kN; ++i) EXPECT_EQ(got.count(i), 1u) << i;
}

}  // namespace
}  // namespace dos
