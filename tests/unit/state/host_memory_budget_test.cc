// ParseBytes: the sizes dosd's flags take (--host_memory_limit=64G, ...).
#include "daemon/state/host_memory_budget.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace dos {
namespace {

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

}  // namespace
}  // namespace dos
