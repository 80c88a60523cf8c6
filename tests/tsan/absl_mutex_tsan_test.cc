// Checks that absl_mutex_tsan.cc is in effect: each test orders plain (not
// atomic) accesses from two threads only through one absl::Mutex entry point.
// Built and run only under -DDOS_SANITIZE=thread, where, without the
// annotations, TSan reports each of these as a data race and fails the test.
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

TEST(AbslMutexTsanTest, LockAndUnlockOrderAccesses) {
  absl::Mutex mu;
  int counter = 0;
  auto work = [&] {
    for (int i = 0; i < 1000; ++i) {
      absl::MutexLock lock(&mu);
      ++counter;
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_EQ(counter, 2000);
}

TEST(AbslMutexTsanTest, ReaderLockSeesWriterUnderLock) {
  absl::Mutex mu;
  int value = 0;
  std::thread writer([&] {
    absl::MutexLock lock(&mu);
    value = 7;
  });
  int seen = -1;
  while (seen != 7) {
    absl::ReaderMutexLock lock(&mu);
    seen = value;
  }
  writer.join();
}

TEST(AbslMutexTsanTest, AwaitAndCondVarHandOff) {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;
  bool acked = false;
  int payload = 0;
  std::thread producer([&] {
    absl::MutexLock lock(&mu);
    payload = 42;
    ready = true;
    cv.Signal();
    mu.Await(absl::Condition(&acked));
    payload = 43;
  });
  {
    absl::MutexLock lock(&mu);
    while (!ready) cv.Wait(&mu);
    EXPECT_EQ(payload, 42);
    acked = true;
  }
  producer.join();
  EXPECT_EQ(payload, 43);
}

TEST(AbslMutexTsanTest, LockWhenWithTimeoutAndTryLock) {
  absl::Mutex mu;
  bool ready = false;
  int payload = 0;
  std::thread producer([&] {
    while (!mu.TryLock()) std::this_thread::yield();
    payload = 5;
    ready = true;
    mu.Unlock();
  });
  ASSERT_TRUE(mu.LockWhenWithTimeout(absl::Condition(&ready), absl::Seconds(60)));
  EXPECT_EQ(payload, 5);
  mu.Unlock();
  producer.join();
}

}  // namespace
}  // namespace dos
