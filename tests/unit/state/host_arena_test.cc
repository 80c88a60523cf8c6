// HostArena (slots on page boundaries, zeroed, huge pages for large
// mappings), parallel first touch with progress, RegisterProgress and its
// control-block mirror.
#include "daemon/state/host_arena.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "daemon/state/register_progress.h"
#include "daemon/state/shard_state.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

TEST(HostArenaTest, SlotsArePageAlignedZeroedAndDisjoint) {
  const std::vector<uint64_t> sizes = {1, 4095, 4096, 4097, 123457};
  auto a = HostArena::Create(sizes, {}, "test");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE((*a)->huge_pages());  // far below the threshold
  RegisterProgress progress;
  progress.BeginPhase(kRegisterAllocating, (*a)->mapped_bytes());
  ASSERT_TRUE((*a)->Touch(&progress).ok());
  uint64_t slot_total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto* p = static_cast<unsigned char*>((*a)->slot(i));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u) << i;
    EXPECT_GE((*a)->slot_bytes(i), sizes[i]);
    for (uint64_t b = 0; b < sizes[i]; ++b) ASSERT_EQ(p[b], 0) << i << " " << b;
    std::memset(p, 0xab, (*a)->slot_bytes(i));  // whole rounded slot is ours
    if (i > 0) {
      EXPECT_GE(p, static_cast<unsigned char*>((*a)->slot(i - 1)) + (*a)->slot_bytes(i - 1));
    }
    slot_total += (*a)->slot_bytes(i);
  }
  // Progress counts every touched byte of every slot.
  EXPECT_EQ(progress.Read().bytes_done, slot_total);
}

TEST(HostArenaTest, TheReadOnlyDescriptorCanNeitherBeReopenedWritableNorSealed) {
  auto a = HostArena::Create(std::vector<uint64_t>{4096}, {}, "test");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<UniqueFd> ro = (*a)->ReadOnlyFd();
  ASSERT_TRUE(ro.ok()) << ro.status();
  struct stat st {};
  ASSERT_EQ(::fstat(ro->get(), &st), 0);
  // Owner-only: a trainer (another uid than dosd's) cannot reopen it
  // writable through /proc/PID/fd (memfds start 0777).
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const int seals = ::fcntl(ro->get(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(::fcntl(ro->get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
}

TEST(HostArenaTest, LargeMappingsAskForHugePagesOnTwoMiBBoundaries) {
  const std::vector<uint64_t> sizes = {40ull << 20, 30ull << 20, 5000};
  auto a = HostArena::Create(sizes, {.huge_pages = true}, "test");
  ASSERT_TRUE(a.ok()) << a.status();
  // madvise may be refused where THP is not built in; the slots are then
  // still 2 MiB-aligned.
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->slot(i)) % HostArena::kHugePage, 0u) << i;
  }
  ASSERT_TRUE((*a)->Touch(nullptr).ok());
  auto off = HostArena::Create(sizes, {.huge_pages = false}, "test");
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->huge_pages());
}

TEST(RegisterProgressTest, PhasesBytesAndMirror) {
  RegisterProgressWords words{};
  RegisterProgress p(&words);
  EXPECT_EQ(p.Read().phase, kRegisterIdle);
  p.BeginPhase(kRegisterAllocating, 1000);
  p.Add(300);
  p.Add(200);
  RegisterProgress::View v = p.Read();
  EXPECT_EQ(v.phase, kRegisterAllocating);
  EXPECT_EQ(v.bytes_done, 500u);
  EXPECT_EQ(v.bytes_total, 1000u);
  EXPECT_GE(v.total_seconds, v.phase_seconds);
  EXPECT_EQ(words.phase.load(), kRegisterAllocating);
  EXPECT_EQ(words.bytes_done.load(), 500u);
  EXPECT_EQ(words.bytes_total.load(), 1000u);
  const uint64_t start = words.start_ns.load();
  EXPECT_GT(start, 0u);
  p.BeginPhase(kRegisterPinning, 64);  // a new phase restarts the bytes, not the clock
  EXPECT_EQ(p.Read().bytes_done, 0u);
  EXPECT_EQ(words.start_ns.load(), start);
  EXPECT_GE(words.phase_start_ns.load(), start);
  EXPECT_STREQ(RegisterPhaseName(words.phase.load()), "pinning");
  p.Finish();
  EXPECT_EQ(p.Read().phase, kRegisterIdle);
  EXPECT_EQ(words.phase.load(), kRegisterIdle);
}

TEST(ShardStateArenaTest, CreateReportsAllocationAndMasterRunsCoverEachTensor) {
  HostMemoryBudget budget(0);
  std::vector<TensorDesc> tensors;
  for (uint64_t n : {7u, 22u, 1u, 64u}) {
    TensorDesc t;
    t.numel = n;
    tensors.push_back(t);
  }
  RegisterProgress progress;
  auto s = ShardState::Create(tensors, {GroupConfig{}}, 10, &budget, "test",
                              {.huge_pages = true, .progress = &progress});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(progress.Read().phase, kRegisterAllocating);
  EXPECT_GE(progress.Read().bytes_done, (*s)->state_bytes());
  for (uint32_t t = 0; t < (*s)->tensors().size(); ++t) {
    uint64_t covered = 0;
    for (const ShardState::MasterRun& r : (*s)->MasterRuns(t)) {
      EXPECT_EQ(r.tensor_offset, covered);
      const Subgroup& g = (*s)->subgroups()[r.subgroup];
      EXPECT_GE(r.master, g.master);
      EXPECT_LE(r.master + r.count, g.master + g.numel);
      EXPECT_EQ(static_cast<float*>(r.moments) - g.exp_avg, r.master - g.master);
      for (uint64_t e = 0; e < r.count; ++e) r.master[e] = static_cast<float>(covered + e);
      covered += r.count;
    }
    EXPECT_EQ(covered, (*s)->tensors()[t].numel);
    std::vector<float> back((*s)->tensors()[t].numel);
    (*s)->ReadTensor(t, 0, back.data());
    for (uint64_t e = 0; e < back.size(); ++e) ASSERT_EQ(back[e], static_cast<float>(e));
  }
}

}  // namespace
}  // namespace dos
