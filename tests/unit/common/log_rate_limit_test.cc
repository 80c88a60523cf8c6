// The log's rate limit for repeated warnings: a few lines per event and
// window, then a count.
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

}  // namespace
}  // namespace dos::log_internal
