// TrainerGate: the checkpointer's wait for a session's trainer wakes when
// the last early step ends, not on a poll, and gives up at its deadline; a
// snapshot and an early step reach the session's lock in the order they
// passed the gate, so an autosave never queues behind a step that waits for
// its trainer.
#include "daemon/session/trainer_gate.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

TEST(TrainerGateTest, NoneAtOnceAndWaitingUntilItsDeadline) {
  TrainerGate g;
  EXPECT_FALSE(g.waiting());
  EXPECT_TRUE(g.WaitUntilNone(absl::InfinitePast()));
  g.BeginEarlyStep();
  g.BeginEarlyStep();
  EXPECT_TRUE(g.waiting());
  EXPECT_FALSE(g.WaitUntilNone(absl::InfinitePast()));  // past: whether none is now
  EXPECT_FALSE(g.WaitUntilNone(absl::Now() + absl::Milliseconds(20)));
  g.EndEarlyStep();
  EXPECT_FALSE(g.WaitUntilNone(absl::InfinitePast()));
  g.EndEarlyStep();
  EXPECT_TRUE(g.WaitUntilNone(absl::InfinitePast()));
}

// The waiter's deadline is far away: it returns because EndEarlyStep() woke it.
TEST(TrainerGateTest, WaiterWakesWhenTheLastEarlyStepEnds) {
  TrainerGate g;
  g.BeginEarlyStep();
  absl::Notification waiting, woke;
  bool result = false;
  absl::Time returned;
  std::thread waiter([&] {
    waiting.Notify();
    result = g.WaitUntilNone(absl::Now() + absl::Seconds(600));
    returned = absl::Now();
    woke.Notify();
  });
  waiting.WaitForNotification();
  EXPECT_FALSE(woke.WaitForNotificationWithTimeout(absl::Milliseconds(20)));  // still waits
  const absl::Time ended = absl::Now();
  g.EndEarlyStep();
  ASSERT_TRUE(woke.WaitForNotificationWithTimeout(absl::Seconds(60)));
  waiter.join();
  EXPECT_TRUE(result);
  EXPECT_LT(returned - ended, absl::Seconds(30));
}

// A step counted first: a snapshot gives up (the checkpointer saves the
// other sessions meanwhile); once the step ended, one queues.
TEST(TrainerGateTest, ASnapshotSkipsAStepCountedFirst) {
  TrainerGate g;
  g.BeginEarlyStep();
  EXPECT_FALSE(g.QueueSnapshot());
  EXPECT_TRUE(g.waiting());
  g.EndEarlyStep();
  EXPECT_TRUE(g.QueueSnapshot());
  g.SnapshotLocked();
}

// A snapshot queued first: the next early step waits at the gate until the
// snapshot holds the lock, so the step cannot lock first and then wait for
// its trainer with the snapshot behind it.
TEST(TrainerGateTest, AStepWaitsForASnapshotQueuedFirst) {
  TrainerGate g;
  ASSERT_TRUE(g.QueueSnapshot());
  absl::Notification started, counted;
  std::thread step([&] {
    started.Notify();
    g.BeginEarlyStep();
    counted.Notify();
  });
  started.WaitForNotification();
  EXPECT_FALSE(counted.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  EXPECT_FALSE(g.waiting());
  g.SnapshotLocked();
  ASSERT_TRUE(counted.WaitForNotificationWithTimeout(absl::Seconds(60)));
  step.join();
  EXPECT_TRUE(g.waiting());
  g.EndEarlyStep();
}

}  // namespace
}  // namespace dos
