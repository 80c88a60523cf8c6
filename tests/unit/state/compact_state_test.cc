// ShardState in compact format (bf16 exp_avg / exp_avg_sq beside the fp32
// master): layout, host accounting, the fp32 view through Read/WriteTensor,
// and copy-on-write snapshots of the smaller allocation.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/state/shard_state.h"
#include "gtest/gtest.h"
#include "tests/unit/state/state_test_util.h"

namespace dos {
namespace {

using testing::Tensors;

std::unique_ptr<ShardState> Make(HostMemoryBudget* budget, std::vector<uint64_t> sizes,
                                 uint64_t sg, StateFormat f) {
  auto s = ShardState::Create(Tensors(std::move(sizes)), {GroupConfig{}}, sg, budget, "test",
                              {.format = f});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(CompactStateTest, EightBytesPerParameterInOneAllocationPerSubgroup) {
  HostMemoryBudget budget(0);
  auto s = Make(&budget, {7, 22, 1, 64}, 10, StateFormat::kCompact);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->format(), StateFormat::kCompact);
  EXPECT_EQ(s->bytes_per_param(), 8u);
  EXPECT_EQ(s->state_bytes(), 94u * 8);
  for (size_t i = 0; i < s->subgroups().size(); ++i) {
    const Subgroup& g = s->subgroups()[i];
    EXPECT_EQ(g.format, StateFormat::kCompact);
    EXPECT_EQ(g.exp_avg, nullptr);
    EXPECT_EQ(g.exp_avg_sq, nullptr);
    // [master fp32 | exp_avg bf16 | exp_avg_sq bf16], back to back.
    EXPECT_EQ(reinterpret_cast<char*>(g.exp_avg_bf16), reinterpret_cast<char*>(g.master + g.numel));
    EXPECT_EQ(g.exp_avg_sq_bf16, g.exp_avg_bf16 + g.numel);
    EXPECT_EQ(g.state_bytes(), g.numel * 8);
    EXPECT_GE(s->arena().slot_bytes(i), g.state_bytes());
  }
}

TEST(CompactStateTest, HostAccountingChargesTwoThirds) {
  // 1024 elements: 3 pages of fp32 state, 2 of compact.
  EXPECT_EQ(ShardState::AllocatedBytes(1024, 1024, StateFormat::kFp32), 3u * 4096);
  EXPECT_EQ(ShardState::AllocatedBytes(1024, 1024, StateFormat::kCompact), 2u * 4096);
  EXPECT_EQ(ShardState::AllocatedBytes(3 * 1024 + 1, 1024, StateFormat::kCompact),
            3u * 2 * 4096 + 4096);
  HostMemoryBudget budget(2 * 4096 * 2);  // room for two compact subgroups, not fp32 ones
  auto compact = ShardState::Create(Tensors({2048}), {GroupConfig{}}, 1024, &budget, "c",
                                    {.format = StateFormat::kCompact});
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_EQ(budget.used(), 4u * 4096);
  compact->reset();
  EXPECT_EQ(budget.used(), 0u);
  auto fp32 = ShardState::Create(Tensors({2048}), {GroupConfig{}}, 1024, &budget, "f");
  EXPECT_EQ(fp32.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(CompactStateTest, TensorsReadAsFp32AndWriteRoundingToNearest) {
  HostMemoryBudget budget(0);
  auto s = Make(&budget, {5, 13, 9}, 4, StateFormat::kCompact);
  ASSERT_NE(s, nullptr);
  for (uint32_t t = 0; t < 3; ++t) {
    const uint64_t n = s->tensors()[t].numel;
    std::vector<float> zero(n, 1.0f);
    for (int which = 0; which < 3; ++which) {
      s->ReadTensor(t, which, zero.data());
      for (float v : zero) ASSERT_EQ(v, 0.0f);
    }
    for (int which = 0; which < 3; ++which) {
      std::vector<float> in(n), out(n);
      for (uint64_t i = 0; i < n; ++i) in[i] = 1.0f + 0.001f * static_cast<float>(i + 7 * t + which);
      s->WriteTensor(t, which, in.data());
      s->ReadTensor(t, which, out.data());
      for (uint64_t i = 0; i < n; ++i) {
        const float want = which == 0 ? in[i] : BF16ToFloat(FloatToBF16(in[i]));
        ASSERT_EQ(FloatToBits(out[i]), FloatToBits(want)) << t << " " << which << " " << i;
      }
      // Ranges cover the same values.
      std::vector<float> part(n > 2 ? n - 2 : 1);
      if (n > 2) {
        s->ReadTensorRange(t, which, 1, n - 2, part.data());
        for (uint64_t i = 0; i + 2 < n; ++i) ASSERT_EQ(part[i], out[i + 1]);
      }
    }
  }
  // A range write touches only its range.
  std::vector<float> ones(3, 2.0f), all(13);
  s->WriteTensorRange(1, 2, 5, 3, ones.data());
  s->ReadTensor(1, 2, all.data());
  for (uint64_t i = 0; i < 13; ++i) {
    if (i >= 5 && i < 8) ASSERT_EQ(all[i], 2.0f);
    else ASSERT_NE(all[i], 2.0f);
  }
}

TEST(CompactStateTest, MasterRunsLeaveRoomToStageFourByteWeights) {
  HostMemoryBudget budget(0);
  auto s = Make(&budget, {5, 13, 9}, 4, StateFormat::kCompact);
  ASSERT_NE(s, nullptr);
  for (uint32_t t = 0; t < 3; ++t) {
    for (const ShardState::MasterRun& r : s->MasterRuns(t)) {
      const Subgroup& g = s->subgroups()[r.subgroup];
      const char* end = reinterpret_cast<const char*>(g.master) + g.state_bytes();
      EXPECT_LE(static_cast<const char*>(r.moments) + 4 * r.count, end);
      EXPECT_EQ(static_cast<uint16_t*>(r.moments) - g.exp_avg_bf16, r.master - g.master);
    }
  }
}

TEST(CompactStateTest, SnapshotCopiesTheCompactAllocation) {
  HostMemoryBudget budget(0);
  auto live = Make(&budget, {500, 300}, 100, StateFormat::kCompact);
  ASSERT_NE(live, nullptr);
  for (Subgroup& g : live->subgroups()) {
    std::memset(g.master, 0x5a, g.state_bytes());
  }
  SnapshotPool pool(uint64_t{1} << 30, nullptr, [](uint64_t) { return true; });
  live->BeginSnapshot(&pool);
  live->BeforeWrite(3);  // copied: the writer reads the copy
  std::memset(live->subgroups()[3].master, 0, live->subgroups()[3].state_bytes());
  for (uint32_t i = 0; i < live->subgroups().size(); ++i) {
    const Subgroup& g = live->SnapshotAcquire(i);
    EXPECT_EQ(g.format, StateFormat::kCompact);
    EXPECT_EQ(reinterpret_cast<const char*>(g.exp_avg_bf16),
              reinterpret_cast<const char*>(g.master) + 4 * g.numel);
    const auto* b = reinterpret_cast<const unsigned char*>(g.master);
    for (uint64_t k = 0; k < g.state_bytes(); ++k) ASSERT_EQ(b[k], 0x5a) << i << " " << k;
  }
  EXPECT_EQ(live->EndSnapshot(), 1u);
  EXPECT_EQ(pool.used(), 0u);
}

}  // namespace
}  // namespace dos
