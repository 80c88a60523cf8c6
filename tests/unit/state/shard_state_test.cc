#include "daemon/state/shard_state.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/state/state_test_util.h"

namespace dos {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::Tensors;

TEST(ShardStateTest, SubgroupsCoverTheFlatSpaceAndSpanTensorBoundaries) {
  HostMemoryBudget budget(0);
  auto s = ShardState::Create(Tensors({7, 22, 1, 64}), {GroupConfig{}}, 10, &budget, "test");
  ASSERT_TRUE(s.ok()) << s.status();
  const ShardState& shard = **s;
  EXPECT_EQ(shard.total_params(), 94u);
  ASSERT_EQ(shard.subgroups().size(), 10u);  // ceil(94 / 10)
  uint64_t flat = 0;
  for (const Subgroup& g : shard.subgroups()) {
    EXPECT_EQ(g.flat_begin, flat);
    uint64_t covered = 0;
    for (const SubgroupSegment& seg : g.segments) {
      EXPECT_EQ(seg.subgroup_offset, covered);
      const TensorDesc& t = shard.tensors()[seg.tensor];
      EXPECT_EQ(shard.flat_offset(seg.tensor) + seg.tensor_offset,
                g.flat_begin + seg.subgroup_offset);
      EXPECT_LE(seg.tensor_offset + seg.count, t.numel);
      covered += seg.count;
    }
    EXPECT_EQ(covered, g.numel);
    flat += g.numel;
  }
  EXPECT_EQ(flat, 94u);
  // Subgroup 0 = all of t0 (7) + 3 of t1; subgroup 2 = [20, 30): the last 9 of t1, then t2.
  ASSERT_EQ(shard.subgroups()[0].segments.size(), 2u);
  EXPECT_EQ(shard.subgroups()[0].segments[1].tensor, 1u);
  EXPECT_EQ(shard.subgroups()[0].segments[1].count, 3u);
  ASSERT_EQ(shard.subgroups()[2].segments.size(), 2u);
  EXPECT_EQ(shard.subgroups()[2].segments[1].tensor, 2u);
}

TEST(ShardStateTest, StateStartsZeroAndTensorsRoundTrip) {
  HostMemoryBudget budget(0);
  auto s = ShardState::Create(Tensors({5, 13, 9}), {GroupConfig{}}, 4, &budget, "test");
  ASSERT_TRUE(s.ok());
  ShardState& shard = **s;
  for (uint32_t t = 0; t < 3; ++t) {
    uint64_t n = shard.tensors()[t].numel;
    for (int which = 0; which < 3; ++which) {
      std::vector<float> zero(n, 1.0f);
      shard.ReadTensor(t, which, zero.data());
      for (float x : zero) EXPECT_EQ(x, 0.0f);
      std::vector<float> in(n), out(n);
      std::iota(in.begin(), in.end(), 100.0f * t + 10.0f * which);
      shard.WriteTensor(t, which, in.data());
      shard.ReadTensor(t, which, out.data());
      EXPECT_EQ(in, out) << "tensor " << t << " array " << which;
    }
  }
  // Writes to one tensor must not leak into its neighbours.
  std::vector<float> t1(13);
  shard.ReadTensor(1, 0, t1.data());
  EXPECT_EQ(t1[0], 100.0f);
  EXPECT_EQ(t1[12], 112.0f);
}

TEST(ShardStateTest, RangesReadAndWriteOnlyTheirElementsAcrossSubgroups) {
  HostMemoryBudget budget(0);
  // t1 (13 elements) spans subgroups of 4 starting mid-subgroup.
  auto s = ShardState::Create(Tensors({5, 13, 9}), {GroupConfig{}}, 4, &budget, "test");
  ASSERT_TRUE(s.ok());
  ShardState& shard = **s;
  for (uint32_t t = 0; t < 3; ++t) {
    std::vector<float> in(shard.tensors()[t].numel);
    std::iota(in.begin(), in.end(), 100.0f * t);
    for (int which = 0; which < 3; ++which) shard.WriteTensor(t, which, in.data());
  }
  for (uint64_t offset = 0; offset < 13; ++offset) {
    for (uint64_t n = 0; offset + n <= 13; ++n) {
      std::vector<float> out(n + 1, -1.0f);
      shard.ReadTensorRange(1, 2, offset, n, out.data());
      for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], 100.0f + offset + i) << offset << "+" << n;
      EXPECT_EQ(out[n], -1.0f) << "read past the range";
    }
  }
  const std::vector<float> patch = {-1.0f, -2.0f, -3.0f, -4.0f, -5.0f, -6.0f};
  shard.WriteTensorRange(1, 1, 3, patch.size(), patch.data());
  std::vector<float> t1(13), t0(5), t2(9), t1_master(13);
  shard.ReadTensor(1, 1, t1.data());
  for (uint64_t i = 0; i < 13; ++i) {
    EXPECT_EQ(t1[i], i >= 3 && i < 9 ? patch[i - 3] : 100.0f + i) << i;
  }
  shard.ReadTensor(0, 1, t0.data());
  shard.ReadTensor(2, 1, t2.data());
  shard.ReadTensor(1, 0, t1_master.data());
  EXPECT_EQ(t0[4], 4.0f);    // neighbours untouched
  EXPECT_EQ(t2[0], 200.0f);
  EXPECT_EQ(t1_master[3], 103.0f);  // other arrays untouched
}

// The budget is charged what is allocated: each subgroup is page-aligned
// (1024 elements are 3 pages exactly; a 1-element tail still takes a page).
TEST(ShardStateTest, BudgetIsReservedAndReleased) {
  HostMemoryBudget budget(3072 * 12);
  {
    auto a = ShardState::Create(Tensors({2048}), {GroupConfig{}}, 1024, &budget, "a");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(budget.used(), 2048u * 12);
    auto b = ShardState::Create(Tensors({1025}), {GroupConfig{}}, 1024, &budget, "register b");
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(b.status().message().find("register b needs"), absl::string_view::npos)
        << b.status();
    EXPECT_NE(b.status().message().find("16384 bytes"), absl::string_view::npos) << b.status();
    EXPECT_EQ(budget.used(), 2048u * 12);
    auto c = ShardState::Create(Tensors({1024}), {GroupConfig{}}, 1024, &budget, "c");
    EXPECT_TRUE(c.ok());
    EXPECT_EQ(budget.used(), 3072u * 12);
  }
  EXPECT_EQ(budget.used(), 0u);
}

TEST(ShardStateTest, TinySubgroupsAreChargedTheirPages) {
  EXPECT_EQ(ShardState::AllocatedBytes(1000, 1), 1000u * 4096);
  EXPECT_EQ(ShardState::AllocatedBytes(1000, 100'000'000), 12288u);
  EXPECT_EQ(ShardState::AllocatedBytes(3072, 1024), 3072u * 12);
  HostMemoryBudget budget(1 << 20);
  auto a = ShardState::Create(Tensors({1000}), {GroupConfig{}}, 1, &budget, "tiny");
  ASSERT_FALSE(a.ok());  // 4 MB of pages for 12 KB of state
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(ShardStateTest, RejectsEmptyShardAndZeroSubgroupSize) {
  HostMemoryBudget budget(0);
  EXPECT_EQ(ShardState::Create({}, {GroupConfig{}}, 8, &budget, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardState::Create(Tensors({3}), {GroupConfig{}}, 0, &budget, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(HostMemoryBudgetTest, UnlimitedAndOverflowSafe) {
  HostMemoryBudget unlimited(0);
  EXPECT_TRUE(unlimited.Reserve(uint64_t{1} << 62, "big").ok());
  HostMemoryBudget b(100);
  EXPECT_TRUE(b.Reserve(60, "x").ok());
  EXPECT_FALSE(b.Reserve(UINT64_MAX, "x").ok());  // must not wrap around
  EXPECT_FALSE(b.Reserve(41, "x").ok());
  EXPECT_TRUE(b.Reserve(40, "x").ok());
  b.Release(100);
  EXPECT_EQ(b.used(), 0u);
}

TEST(FormatBytesTest, HumanUnits) {
  EXPECT_EQ(FormatBytes(12), "12 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.00 GiB");
}

// Copy-on-write snapshot raced by a step and the checkpoint's writer
// (threads TSan follows: the per-subgroup atomics are all there is). What
// the writer reads must be bitwise the state at BeginSnapshot whatever the
// interleaving and whatever room the pool has (none: the step waits for the
// writer; some; plenty), and the pool never holds more than its limit;
// repeated to shake out orders.
TEST(ShardStateSnapshotTest, AStepAndTheWriterRaceToABitwiseStepBoundary) {
  HostMemoryBudget budget(0);
  auto live = ShardState::Create(Tensors({5000, 3000, 8000}), {GroupConfig{}}, 1000, &budget,
                                 "live");
  ASSERT_TRUE(live.ok());
  ShardState& shard = **live;
  const size_t n = shard.subgroups().size();
  ASSERT_EQ(n, 16u);
  const uint64_t sg_bytes = shard.subgroups()[0].state_bytes();
  auto fill = [&](float base) {
    for (Subgroup& g : shard.subgroups()) {
      for (uint64_t e = 0; e < 3 * g.numel; ++e) g.master[e] = base + static_cast<float>(e);
    }
  };
  for (uint64_t limit : {uint64_t{0}, 3 * sg_bytes, 100 * sg_bytes}) {
    SnapshotPool pool(limit, nullptr, [](uint64_t) { return true; });
    for (int round = 0; round < 20; ++round) {
      fill(static_cast<float>(round));
      shard.BeginSnapshot(&pool);
      std::thread step([&] {
        // Every subgroup, in the order the CPU path takes them (back first
        // on odd rounds, as the CPU claims from the back under auto).
        for (size_t k = 0; k < n; ++k) {
          const uint32_t i = static_cast<uint32_t>(round % 2 ? n - 1 - k : k);
          shard.BeforeWrite(i);
          Subgroup& g = shard.subgroups()[i];
          for (uint64_t e = 0; e < 3 * g.numel; ++e) g.master[e] = -1.0f;
        }
      });
      // The writer: in order, letting each go once read (as SaveSnapshot).
      for (uint32_t i = 0; i < n; ++i) {
        const Subgroup& g = shard.SnapshotAcquire(i);
        for (uint64_t e = 0; e < 3 * g.numel; ++e) {
          ASSERT_EQ(g.master[e], static_cast<float>(round) + static_cast<float>(e))
              << "limit " << limit << " round " << round << " subgroup " << i;
        }
        shard.SnapshotReleaseBelow(i + 1);
      }
      const uint32_t by_steps = shard.EndSnapshot();
      step.join();
      if (limit == 0) {
        EXPECT_EQ(by_steps, 0u);  // (with room, buffers freed are taken again)
      }
      EXPECT_FALSE(shard.snapshot_in_progress());
      EXPECT_EQ(pool.used(), 0u);
      EXPECT_LE(pool.TakePeak(), limit);
      // And the step's values are what the live state holds.
      for (const Subgroup& g : shard.subgroups()) ASSERT_EQ(g.master[0], -1.0f);
    }
  }
}

// A step ahead of the writer: it copies what the pool has room for, and
// once the pool is spent waits for the writer, which reads those copies and
// the rest in place.
TEST(ShardStateSnapshotTest, AStepCopiesWhatThePoolHoldsThenWaitsForTheWriter) {
  HostMemoryBudget budget(0);
  auto live = ShardState::Create(Tensors({4000}), {GroupConfig{}}, 1000, &budget, "live");
  ASSERT_TRUE(live.ok());
  ShardState& shard = **live;
  for (Subgroup& g : shard.subgroups()) std::fill_n(g.master, 3 * g.numel, 7.0f);
  SnapshotPool pool(2 * shard.subgroups()[0].state_bytes(), nullptr, [](uint64_t) { return true; });
  shard.BeginSnapshot(&pool);
  // Subgroups 3 and 2 are copied (the pool's room); 1 then waits.
  std::atomic<int> written{0};
  std::thread step([&] {
    for (uint32_t i : {3u, 2u, 1u, 0u}) {
      shard.BeforeWrite(i);
      std::fill_n(shard.subgroups()[i].master, 3 * shard.subgroups()[i].numel, -1.0f);
      written.fetch_add(1);
    }
  });
  while (pool.used() < pool.limit()) std::this_thread::yield();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_LE(written.load(), 2);  // waiting for subgroup 1 until the writer passes it
  for (uint32_t i = 0; i < 4; ++i) {
    const Subgroup& g = shard.SnapshotAcquire(i);
    ASSERT_EQ(g.master[0], 7.0f) << i;
    ASSERT_EQ(g.master[3 * g.numel - 1], 7.0f) << i;
    shard.SnapshotReleaseBelow(i + 1);
  }
  EXPECT_EQ(shard.EndSnapshot(), 2u);
  step.join();
  EXPECT_EQ(written.load(), 4);
  EXPECT_EQ(pool.used(), 0u);
}

// The pool's buffers are charged to the daemon's budget while they live: no
// copy when the budget is full.
TEST(SnapshotPoolTest, BuffersAreChargedToTheBudgetAndGiveItBack) {
  HostMemoryBudget budget(10 << 20);
  SnapshotPool pool(100 << 20, &budget);
  SnapshotPool::Buffer a = pool.TryTake(6 << 20);
  ASSERT_TRUE(a);
  EXPECT_EQ(budget.used(), uint64_t{6} << 20);
  EXPECT_FALSE(pool.TryTake(6 << 20));  // the budget has 4 MiB left
  EXPECT_EQ(budget.used(), uint64_t{6} << 20);
  // A registration refused meanwhile is told what holds the room and that it is passing.
  const absl::Status refused = budget.Reserve(5 << 20, "session 7's shard");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("6.00 MiB of it is checkpoint staging"));
  EXPECT_THAT(refused.message(), HasSubstr("retry once the saves finish"));
  static_cast<char*>(a.data())[(6 << 20) - 1] = 1;  // writable
  a.Reset();
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_EQ(pool.used(), 0u);
  EXPECT_THAT(budget.Reserve(11 << 20, "session 7's shard").message(), Not(HasSubstr("staging")));
  SnapshotPool none(0, nullptr);
  EXPECT_FALSE(none.TryTake(1));
}

// Nor when the host cannot hold it (CheckHostCanHold by default).
TEST(SnapshotPoolTest, NoBufferTheHostHasNotGot) {
  bool room = true;
  SnapshotPool pool(uint64_t{1} << 40, nullptr, [&](uint64_t) { return room; });
  EXPECT_TRUE(pool.TryTake(1 << 20));
  room = false;
  EXPECT_FALSE(pool.TryTake(1 << 20));
  EXPECT_EQ(pool.used(), 0u);
  SnapshotPool host(uint64_t{1} << 62, nullptr);
  EXPECT_FALSE(host.TryTake(uint64_t{1} << 61));  // no host has 2 EiB to spare
  EXPECT_GT(DefaultSnapshotPoolLimit(), 0u);
}

}  // namespace
}  // namespace dos
