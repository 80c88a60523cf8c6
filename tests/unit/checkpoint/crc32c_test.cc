#include "daemon/checkpoint/crc32c.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dos::crc32c {
namespace {

// RFC 3720, appendix B.4.
TEST(Crc32cTest, StandardVectors) {
  char buf[32];
  std::memset(buf, 0, sizeof buf);
  EXPECT_EQ(Value(buf, sizeof buf), 0x8a9136aau);
  std::memset(buf, 0xff, sizeof buf);
  EXPECT_EQ(Value(buf, sizeof buf), 0x62a8ab43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(i);
  EXPECT_EQ(Value(buf, sizeof buf), 0x46dd794eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(31 - i);
  EXPECT_EQ(Value(buf, sizeof buf), 0x113fdb5cu);
  EXPECT_EQ(Value("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Value("", 0), 0u);
}

TEST(Crc32cTest, PortableMatchesDispatchedAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::vector<char> data(4096 + 16);
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t align = 0; align < 8; ++align) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      EXPECT_EQ(Extend(0, data.data() + align, n), ExtendPortable(0, data.data() + align, n))
          << "align " << align << " n " << n;
    }
  }
  RecordProperty("hardware", HardwareAccelerated() ? "sse4.2" : "none");
}

TEST(Crc32cTest, ExtendComposes) {
  std::string s = "the quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    uint32_t a = Value(s.data(), cut);
    EXPECT_EQ(Extend(a, s.data() + cut, s.size() - cut), Value(s.data(), s.size()));
    EXPECT_EQ(ExtendPortable(ExtendPortable(0, s.data(), cut), s.data() + cut, s.size() - cut),
              Value(s.data(), s.size()));
  }
}

}  // namespace
}  // namespace dos::crc32c
