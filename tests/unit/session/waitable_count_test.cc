// WaitableCount: the checkpointer's wait for a session's trainer wakes when
// the last wait ends, not on a poll, and gives up at its deadline.
#include "daemon/session/waitable_count.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

TEST(WaitableCountTest, ZeroAtOnceAndNonzeroUntilItsDeadline) {
  WaitableCount n;
  EXPECT_FALSE(n.nonzero());
  EXPECT_TRUE(n.WaitForZero(absl::InfinitePast()));
  n.Add();
  n.Add();
  EXPECT_TRUE(n.nonzero());
  EXPECT_FALSE(n.WaitForZero(absl::InfinitePast()));  // past: whether it is zero now
  EXPECT_FALSE(n.WaitForZero(absl::Now() + absl::Milliseconds(20)));
  n.Remove();
  EXPECT_FALSE(n.WaitForZero(absl::InfinitePast()));
  n.Remove();
  EXPECT_TRUE(n.WaitForZero(absl::InfinitePast()));
}

// The waiter's deadline is far away: it returns because Remove() woke it.
TEST(WaitableCountTest, WaiterWakesWhenTheLastWaitEnds) {
  WaitableCount n;
  n.Add();
  absl::Notification waiting, woke;
  bool result = false;
  absl::Time returned;
  std::thread waiter([&] {
    waiting.Notify();
    result = n.WaitForZero(absl::Now() + absl::Seconds(600));
    returned = absl::Now();
    woke.Notify();
  });
  waiting.WaitForNotification();
  EXPECT_FALSE(woke.WaitForNotificationWithTimeout(absl::Milliseconds(20)));  // still waits
  const absl::Time removed = absl::Now();
  n.Remove();
  ASSERT_TRUE(woke.WaitForNotificationWithTimeout(absl::Seconds(60)));
  waiter.join();
  EXPECT_TRUE(result);
  EXPECT_LT(returned - removed, absl::Seconds(30));
}

}  // namespace
}  // namespace dos
