// ParseBytes: the sizes dosd's flags take (--host_memory_limit=64G, ...).
// HoldWhileViewed: a closed shard's state that its owner still maps stays
// charged (bytes and the uid's state views) until nothing maps it.
#include "daemon/state/host_memory_budget.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "daemon/state/shard_state.h"
#include "gtest/gtest.h"
#include "state_test_util.h"

namespace dos {
namespace {

using testing::Tensors;

TEST(ParseBytesTest, SuffixesArePowersOf1024) {
  uint64_t v = 0;
  EXPECT_TRUE(ParseBytes("0", &v));
  EXPECT_EQ(v, 0u);
  EXPECT_TRUE(ParseBytes("4096", &v));
  EXPECT_EQ(v, 4096u);
  EXPECT_TRUE(ParseBytes("16k", &v));
  EXPECT_EQ(v, 16u << 10);
  EXPECT_TRUE(ParseBytes("512M", &v));
  EXPECT_EQ(v, uint64_t{512} << 20);
  EXPECT_TRUE(ParseBytes("64G", &v));
  EXPECT_EQ(v, uint64_t{64} << 30);
  EXPECT_TRUE(ParseBytes("2t", &v));
  EXPECT_EQ(v, uint64_t{2} << 40);
}

TEST(ParseBytesTest, RefusesWhatIsNotASize) {
  uint64_t v = 7;
  for (const char* bad : {"", "G", "12X", "1.5G", "-1", "99999999999T"}) {
    EXPECT_FALSE(ParseBytes(bad, &v)) << bad;
  }
  EXPECT_EQ(v, 7u);  // untouched
}

class HeldViewsTest : public ::testing::Test {
 protected:
  static UidLimits Limits() {
    UidLimits l;
    l.per_uid[static_cast<int>(UidResource::kStateViews)] = 4;
    return l;
  }
  std::unique_ptr<ShardState> Shard() {
    auto s = ShardState::Create(Tensors({4096}), {GroupConfig{}}, 1024, &budget_, "test");
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  // A shard charged as the session charges one at its first export: one of
  // the uid's state views.
  std::unique_ptr<ShardState> ChargedShard() {
    std::unique_ptr<ShardState> s = Shard();
    auto c = ledger_.Charge(1000, UidResource::kStateViews, 1, "state memory");
    EXPECT_TRUE(c.ok()) << c.status();
    if (s == nullptr || !c.ok()) return nullptr;
    s->set_views_charge(std::move(*c));
    return s;
  }
  uint64_t Views() {
    auto snap = ledger_.Snapshot();
    return snap.count(1000) ? snap[1000].used[static_cast<int>(UidResource::kStateViews)] : 0;
  }
  UidLedger ledger_{Limits()};  // outlives the budget, which may hold its charges
  HostMemoryBudget budget_{uint64_t{1} << 20};
};

TEST_F(HeldViewsTest, AClosedShardsStateStaysChargedWhileItsOwnerMapsIt) {
  auto s = ChargedShard();
  ASSERT_NE(s, nullptr);
  const uint64_t bytes = budget_.used();
  ASSERT_GT(bytes, 0u);
  auto m = s->ExportStateMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  const size_t len = s->arena().file_bytes();
  // The trainer maps its views and closes the descriptor, as libdos_client does.
  void* view = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, m->state.get(), 0);
  ASSERT_NE(view, MAP_FAILED);
  m->state.reset();
  s.reset();
  EXPECT_EQ(budget_.used(), bytes);
  EXPECT_EQ(budget_.viewed().bytes, bytes);
  EXPECT_EQ(budget_.viewed().shards, 1u);
  EXPECT_EQ(Views(), 1u);
  budget_.ReapViews();
  EXPECT_EQ(budget_.used(), bytes) << "still mapped";
  // A registration past the limit names what holds the memory and the fix.
  absl::Status st = budget_.Reserve((uint64_t{1} << 20) - bytes + 1, "register x");
  ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(st.message()).find("state_dict() views a trainer still holds"),
            std::string::npos)
      << st;
  ::munmap(view, len);
  // The next reservation past the limit reaps first: it fits now.
  EXPECT_TRUE(budget_.Reserve((uint64_t{1} << 20) - 4096, "register y").ok());
  EXPECT_EQ(budget_.viewed().shards, 0u);
  EXPECT_EQ(Views(), 0u);
}

TEST_F(HeldViewsTest, AnOpenDescriptorWithoutAMappingHoldsItToo) {
  auto s = ChargedShard();
  ASSERT_NE(s, nullptr);
  auto m = s->ExportStateMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  s.reset();
  EXPECT_EQ(budget_.viewed().shards, 1u);
  m->state.reset();
  budget_.ReapViews();
  EXPECT_EQ(budget_.used(), 0u);
  EXPECT_EQ(Views(), 0u);
}

TEST_F(HeldViewsTest, StateWhoseViewsAreGoneIsReleasedWithItsShard) {
  auto s = ChargedShard();
  ASSERT_NE(s, nullptr);
  {
    auto m = s->ExportStateMemory();
    ASSERT_TRUE(m.ok()) << m.status();
  }
  EXPECT_EQ(Views(), 1u) << "charged while the shard lives";
  s.reset();
  EXPECT_EQ(budget_.used(), 0u);
  EXPECT_EQ(budget_.viewed().shards, 0u);
  EXPECT_EQ(Views(), 0u);
  // Never exported: released at once, as always.
  auto t = Shard();
  ASSERT_NE(t, nullptr);
  t.reset();
  EXPECT_EQ(budget_.used(), 0u);
}

TEST_F(HeldViewsTest, StillViewedSeesAnotherProcesssMapping) {
  auto s = Shard();
  ASSERT_NE(s, nullptr);
  auto m = s->ExportStateMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  const size_t len = s->arena().file_bytes();
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(go[1]);
    void* v = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, m->state.get(), 0);
    ::close(m->state.get());
    char c;
    (void)!::read(go[0], &c, 1);  // until the parent has checked
    _exit(v == MAP_FAILED ? 1 : 0);
  }
  m->state.reset();
  ::close(go[0]);
  s.reset();
  EXPECT_EQ(budget_.viewed().shards, 1u);
  ::close(go[1]);  // the child exits: its mapping goes with it
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_EQ(status, 0);
  budget_.ReapViews();
  EXPECT_EQ(budget_.viewed().shards, 0u);
  EXPECT_EQ(budget_.used(), 0u);
}

}  // namespace
}  // namespace dos
