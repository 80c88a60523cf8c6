#include "daemon/sched/policy.h"

#include "gtest/gtest.h"

namespace dos {
namespace {

TEST(PolicyTest, ParsesAndFormatsEveryPolicy) {
  for (const char* text : {"cpu", "auto", "static:0.5", "static:0", "static:1", "interleave:3"}) {
    auto p = ParsePolicy(text);
    ASSERT_TRUE(p.ok()) << text << ": " << p.status();
    EXPECT_EQ(FormatPolicy(*p), text);
  }
  EXPECT_EQ(ParsePolicy("interleave:4")->stride, 4);
  EXPECT_EQ(ParsePolicy("static:0.25")->fraction, 0.25);
}

TEST(PolicyTest, RejectsBadInputNamingIt) {
  for (const char* text : {"", "gpu", "static:", "static:1.5", "static:-0.1", "static:nan",
                           "interleave:0", "interleave:x", "interleave:-2", "AUTO"}) {
    auto p = ParsePolicy(text);
    ASSERT_FALSE(p.ok()) << text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("expected one of"), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace dos
