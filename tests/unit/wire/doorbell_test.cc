#include "dos/wire/doorbell.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "dos/wire/shm_segment.h"
#include "gtest/gtest.h"
#include "tests/unit/wire/test_util.h"

namespace dos {
namespace {

using ::dos::testing::ForkPeer;
using ::dos::testing::UniqueShmName;
using ::dos::testing::WaitExit;

// Two bells, as a control block has: ping (parent -> child), pong (back).
struct Bells {
  alignas(64) std::atomic<uint32_t> ping{0};
  std::atomic<uint32_t> ping_sleeping{0};
  alignas(64) std::atomic<uint32_t> pong{0};
  std::atomic<uint32_t> pong_sleeping{0};
  uint64_t payload = 0;  // plain data published by the bells
};

std::unique_ptr<ShmSegment> MakeSegment(const char* tag) {
  auto seg = ShmSegment::Create(UniqueShmName(tag), sizeof(Bells));
  if (!seg.ok()) return nullptr;
  new ((*seg)->data()) Bells();
  return *std::move(seg);
}

TEST(DoorbellTest, PingPongAcrossProcesses) {
  constexpr uint32_t kRounds = 100'000;
  constexpr absl::Duration kTimeout = absl::Seconds(10);
  auto seg = MakeSegment("pingpong");
  ASSERT_NE(seg, nullptr);
  Bells* b = static_cast<Bells*>(seg->data());

  pid_t child = ForkPeer([b] {
    Doorbell ping(&b->ping, &b->ping_sleeping);
    Doorbell pong(&b->pong, &b->pong_sleeping);
    uint32_t last = 0;
    for (uint32_t i = 1; i <= kRounds; ++i) {
      uint32_t seen = ping.WaitChange(last, kTimeout);
      if (seen == last) return 1;            // timed out
      if (seen != i) return 2;               // skipped or repeated a seq
      if (b->payload != 3ull * i) return 3;  // data not published by the bell
      b->payload = 3ull * i + 1;
      pong.Ring(i);
      last = seen;
    }
    return 0;
  });
  ASSERT_GT(child, 0);

  Doorbell ping(&b->ping, &b->ping_sleeping);
  Doorbell pong(&b->pong, &b->pong_sleeping);
  uint32_t failures = 0;
  for (uint32_t i = 1; i <= kRounds && failures == 0; ++i) {
    b->payload = 3ull * i;
    ping.Ring(i);
    if (!pong.WaitFor(i, kTimeout)) {
      ADD_FAILURE() << "round " << i << ": no pong within " << kTimeout;
      ++failures;
    } else if (b->payload != 3ull * i + 1) {
      ADD_FAILURE() << "round " << i << ": payload " << b->payload;
      ++failures;
    }
  }
  if (failures != 0) kill(child, SIGKILL);
  EXPECT_EQ(WaitExit(child), 0);
}

TEST(DoorbellTest, WaiterTimesOut) {
  std::atomic<uint32_t> bell{7};
  std::atomic<uint32_t> sleeping{0};
  Doorbell d(&bell, &sleeping);

  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(d.WaitChange(7, absl::Milliseconds(20)), 7u);
  EXPECT_FALSE(d.WaitFor(8, absl::Milliseconds(20)));
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::milliseconds(40));
  EXPECT_EQ(sleeping.load(), 0u);  // the announcement is withdrawn

  // Zero and negative timeouts only look.
  EXPECT_EQ(d.WaitChange(7, absl::ZeroDuration()), 7u);
  EXPECT_FALSE(d.WaitFor(8, -absl::Seconds(1)));
}

TEST(DoorbellTest, AlreadyRungReturnsAtOnce) {
  std::atomic<uint32_t> bell{0};
  std::atomic<uint32_t> sleeping{0};
  Doorbell d(&bell, &sleeping);
  d.Ring(5);
  EXPECT_EQ(d.Load(), 5u);
  EXPECT_EQ(d.WaitChange(4, absl::InfiniteDuration()), 5u);
  EXPECT_TRUE(d.WaitFor(5, absl::InfiniteDuration()));
}

// Pairs of threads ping-pong with random delays around the spin window, so
// that rings land before, during and after the waiter's switch to sleeping.
// A lost wake-up shows as a wait that runs into its (long) timeout.
TEST(DoorbellTest, NoLostWakeupsUnderStress) {
  constexpr int kPairs = 3;
  constexpr uint32_t kRounds = 3000;
  constexpr absl::Duration kTimeout = absl::Seconds(10);
  std::vector<Bells> bells(kPairs);
  std::atomic<int> lost{0};

  // Busy-waits a random 0..2x the polling window before ringing.
  auto jitter = [](std::mt19937& rng) {
    const int64_t max_ns = 2 * absl::ToInt64Nanoseconds(Doorbell::kSpin + Doorbell::kYieldSpin);
    const auto until =
        std::chrono::steady_clock::now() +
        std::chrono::nanoseconds(std::uniform_int_distribution<int64_t>(0, max_ns)(rng));
    while (std::chrono::steady_clock::now() < until) {
    }
  };

  std::vector<std::thread> threads;
  for (int p = 0; p < kPairs; ++p) {
    Bells* b = &bells[p];
    threads.emplace_back([b, p, &lost, jitter] {
      std::mt19937 rng(p);
      Doorbell ping(&b->ping, &b->ping_sleeping);
      Doorbell pong(&b->pong, &b->pong_sleeping);
      for (uint32_t i = 1; i <= kRounds; ++i) {
        if (ping.WaitChange(i - 1, kTimeout) != i) {
          lost.fetch_add(1);
          return;
        }
        jitter(rng);
        pong.Ring(i);
      }
    });
    threads.emplace_back([b, p, &lost, jitter] {
      std::mt19937 rng(1000 + p);
      Doorbell ping(&b->ping, &b->ping_sleeping);
      Doorbell pong(&b->pong, &b->pong_sleeping);
      for (uint32_t i = 1; i <= kRounds; ++i) {
        jitter(rng);
        ping.Ring(i);
        if (!pong.WaitFor(i, kTimeout)) {
          lost.fetch_add(1);
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(lost.load(), 0);
}

}  // namespace
}  // namespace dos
