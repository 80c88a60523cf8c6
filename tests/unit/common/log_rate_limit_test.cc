// The log's rate limit for repeated warnings: a few lines per event and
// window, then a count; and its values, which cannot forge a line.
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

}  // namespace
}  // namespace dos::log_internal
