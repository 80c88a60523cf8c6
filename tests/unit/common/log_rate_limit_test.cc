// The log's rate limit for repeated warnings: a few lines per event and
// window, then a count; and its values, which cannot forge a line.
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "gtest/gtest.h"

namespace dos::log_internal {
namespace {

TEST(RateLimiterTest, KeepsAFewLinesPerEventThenCountsTheRest) {
  RateLimiter r(3, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(r.Admit("step.failed", t0).emit);
  RateLimiter::Decision d = r.Admit("step.failed", t0);
  EXPECT_FALSE(d.emit);
  EXPECT_TRUE(d.first_suppressed);
  for (int i = 0; i < 99; ++i) EXPECT_FALSE(r.Admit("step.failed", t0 + absl::Seconds(1)).emit);
  EXPECT_TRUE(r.Admit("other.event", t0).emit);  // events are limited apart
  d = r.Admit("step.failed", t0 + absl::Seconds(11));
  EXPECT_TRUE(d.emit);
  EXPECT_EQ(d.suppressed_before, 100u);
  EXPECT_EQ(r.Admit("step.failed", t0 + absl::Seconds(11)).suppressed_before, 0u);
}

// A value from a client (a tensor name) with a CR, an escape sequence or a
// newline stays one quoted field of one line: control bytes are \xNN.
TEST(AppendFieldTest, ControlBytesInAValueCannotForgeALine) {
  std::string line;
  AppendField(&line, "name", "w\r\x1b[2Kevent=session.close\nsession=1\x7f");
  EXPECT_EQ(line, " name=\"w\\x0d\\x1b[2Kevent=session.close\\nsession=1\\x7f\"");
  line.clear();
  AppendField(&line, "name", "plain.weight");
  EXPECT_EQ(line, " name=plain.weight");
  line.clear();
  AppendField(&line, "path", "a \"b\"\\c");
  EXPECT_EQ(line, " path=\"a \\\"b\\\"\\\\c\"");
}

// Lines are limited per event and uid; a client's name that says uid=...
// (a quoted value) is not the line's uid, so one user can neither escape
// the limit with made-up uids nor use up another user's lines.
TEST(LimitKeyTest, TheLinesUidOutsideQuotedValues) {
  std::string fields;
  AppendField(&fields, "client", "x uid=1001 \"y uid=7");
  AppendField(&fields, "uid", "1000");
  AppendField(&fields, "pid", "42");
  EXPECT_EQ(LimitKey("session.attach", fields), "session.attach uid=1000");
  fields.clear();
  AppendField(&fields, "client", "uid=5 z");
  EXPECT_EQ(LimitKey("session.attach", fields), "session.attach");
  EXPECT_EQ(LimitKey("e", " uid=3"), "e uid=3");
}

TEST(RateLimiterTest, IdleWindowsAreDroppedPastTheBound) {
  RateLimiter r(1, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 5000; ++i) EXPECT_TRUE(r.Admit(absl::StrCat("e uid=", i), t0).emit);
  EXPECT_FALSE(r.Admit("e uid=1", t0).emit);  // its window still counts
  // Later, past the bound, idle windows go; one with lines to report stays.
  EXPECT_TRUE(r.Admit("e uid=9999", t0 + absl::Seconds(20)).emit);
  const auto left = r.TakeSuppressed();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].first, "e uid=1");
}

}  // namespace
}  // namespace dos::log_internal
