#include "dos/wire/control_channel.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "dos/wire/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/wire/test_util.h"

namespace dos {
namespace {

using ::dos::testing::ForkPeer;
using ::dos::testing::UniqueShmName;
using ::dos::testing::WaitExit;
using ::testing::HasSubstr;

constexpr absl::Duration kLong = absl::Seconds(10);

class ControlChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto seg = ShmSegment::Create(UniqueShmName("ctl"), sizeof(ControlBlock));
    ASSERT_TRUE(seg.ok()) << seg.status();
    segment_ = *std::move(seg);
    block_ = static_cast<ControlBlock*>(segment_->data());
    // The test process plays the client; forked children play the daemon
    // and write their own pid below.
    ControlBlockChannel::InitBlock(block_, /*session_id=*/12, /*daemon_pid=*/getpid());
  }

  std::unique_ptr<ShmSegment> segment_;
  ControlBlock* block_ = nullptr;
};

// The payload both sides derive from a step's seq.
double Lr(uint32_t seq, uint32_t group) { return 1e-3 * seq + group; }

TEST_F(ControlChannelTest, StepsRoundTripAcrossProcessesWithPayload) {
  constexpr uint32_t kSteps = 2000;
  constexpr uint32_t kGroups = 3;
  pid_t daemon = ForkPeer([this] {
    ControlBlockChannel channel(block_);
    uint32_t last = 0;
    for (uint32_t n = 0; n < kSteps; ++n) {
      const uint32_t seq = channel.WaitRequest(last, kLong);
      if (seq != last + 1) return 1;
      const StepRequest& req = block_->request;
      if (req.seq != seq || req.num_groups != kGroups || req.grad_scale != seq) return 2;
      for (uint32_t g = 0; g < kGroups; ++g) {
        if (req.groups[g].lr != Lr(seq, g)) return 3;
      }
      StepResult& res = block_->result;
      res.status_code = 0;
      res.step = 10 * static_cast<int64_t>(seq);
      std::snprintf(res.message, sizeof(res.message), "step %u", seq);
      channel.PostResult(seq);
      last = seq;
    }
    return 0;
  });
  ASSERT_GT(daemon, 0);
  block_->daemon_pid = daemon;

  ControlBlockChannel channel(block_);
  ASSERT_TRUE(ControlBlockChannel::Validate(block_, segment_->size()).ok());
  for (uint32_t n = 1; n <= kSteps; ++n) {
    ASSERT_TRUE(channel.Idle());
    StepRequest& req = block_->request;
    req.num_groups = kGroups;
    req.grad_scale = n;
    for (uint32_t g = 0; g < kGroups; ++g) req.groups[g].lr = Lr(n, g);
    const uint32_t seq = channel.PublishRequest();
    ASSERT_EQ(seq, n);
    absl::Status s = channel.WaitResult(seq, kLong);
    if (!s.ok()) kill(daemon, SIGKILL);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(block_->result.seq, seq);
    EXPECT_EQ(block_->result.step, 10 * static_cast<int64_t>(seq));
    ASSERT_STREQ(block_->result.message, ("step " + std::to_string(seq)).c_str());
  }
  EXPECT_EQ(WaitExit(daemon), 0);
}

TEST_F(ControlChannelTest, WaitResultIsUnavailableWhenDaemonExits) {
  pid_t daemon = ForkPeer([this] {
    // Take the request, then die without answering.
    ControlBlockChannel channel(block_);
    return channel.WaitRequest(0, kLong) == 1 ? 0 : 1;
  });
  ASSERT_GT(daemon, 0);
  block_->daemon_pid = daemon;
  ControlBlockChannel channel(block_);
  const uint32_t seq = channel.PublishRequest();
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = channel.WaitResult(seq, kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("pid ", daemon)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(WaitExit(daemon), 0);
}

TEST_F(ControlChannelTest, WaitResultIsUnavailableWhenSessionClosed) {
  int release[2];
  ASSERT_EQ(pipe(release), 0);
  pid_t daemon = ForkPeer([this, &release] {
    close(release[1]);
    ControlBlockChannel channel(block_);
    if (channel.WaitRequest(0, kLong) != 1) return 1;
    channel.Close();
    char c;
    // Stay alive until the client has seen the close (EOF when it closes).
    return read(release[0], &c, 1) < 0 ? 2 : 0;
  });
  ASSERT_GT(daemon, 0);
  close(release[0]);
  block_->daemon_pid = daemon;
  ControlBlockChannel channel(block_);
  absl::Status s = channel.WaitResult(channel.PublishRequest(), kLong);
  close(release[1]);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("closed session 12"));
  EXPECT_EQ(WaitExit(daemon), 0);
}

TEST_F(ControlChannelTest, WaitResultTimesOutWhileDaemonLives) {
  ControlBlockChannel channel(block_);  // daemon_pid is this live process
  const uint32_t seq = channel.PublishRequest();
  EXPECT_FALSE(channel.Idle());
  absl::Status s = channel.WaitResult(seq, absl::Milliseconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // The answer may still come; waiting again for the same seq then succeeds.
  channel.PostResult(seq);
  EXPECT_TRUE(channel.WaitResult(seq, absl::Milliseconds(30)).ok());
  EXPECT_TRUE(channel.Idle());
}

TEST_F(ControlChannelTest, DaemonWaitRequestTimesOut) {
  ControlBlockChannel channel(block_);
  EXPECT_EQ(channel.WaitRequest(0, absl::Milliseconds(5)), 0u);
}

TEST_F(ControlChannelTest, ValidateChecksMagicVersionAndSize) {
  EXPECT_TRUE(ControlBlockChannel::Validate(block_, segment_->size()).ok());
  EXPECT_EQ(block_->session_id, 12u);

  absl::Status small = ControlBlockChannel::Validate(block_, 64);
  EXPECT_EQ(small.code(), absl::StatusCode::kFailedPrecondition);

  block_->version = kProtocolVersion + 1;
  absl::Status version = ControlBlockChannel::Validate(block_);
  EXPECT_EQ(version.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(version.message(), HasSubstr(absl::StrCat("version ", kProtocolVersion + 1)));
  EXPECT_THAT(version.message(), HasSubstr(absl::StrCat("speaks ", kProtocolVersion)));

  block_->magic = 0;
  EXPECT_THAT(ControlBlockChannel::Validate(block_).message(), HasSubstr("magic"));
}

TEST(ProcessAliveTest, SeesLiveZombieAndReapedProcesses) {
  EXPECT_TRUE(ControlBlockChannel::ProcessAlive(getpid()));
  EXPECT_FALSE(ControlBlockChannel::ProcessAlive(0));
  EXPECT_FALSE(ControlBlockChannel::ProcessAlive(-1));

  pid_t child = ForkPeer([] { return 0; });
  ASSERT_GT(child, 0);
  // The child is a zombie once waitid(WNOWAIT) reports it, without reaping.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);
  EXPECT_FALSE(ControlBlockChannel::ProcessAlive(child));
  EXPECT_EQ(WaitExit(child), 0);
  EXPECT_FALSE(ControlBlockChannel::ProcessAlive(child));
}

// Per-subgroup progress: a client waiting for subgroups [first, last] of a
// step returns once exactly those are marked, in any order, across
// processes; the words past the tracked ones share the last, stored at the
// step's end.
TEST_F(ControlChannelTest, SubgroupWaitsFollowTheDaemonsMarksAcrossProcesses) {
  ControlBlockChannel client(block_);
  const uint32_t seq = client.PublishRequest();
  // Nothing marked yet: a bounded wait times out naming the subgroup.
  absl::Status early = client.WaitSubgroups(3, 5, seq, absl::Milliseconds(30));
  EXPECT_TRUE(absl::IsDeadlineExceeded(early)) << early;
  EXPECT_THAT(early.message(), HasSubstr("subgroup 3"));

  pid_t daemon = ForkPeer([this, seq] {
    ControlBlockChannel channel(block_);
    // Out of order, as the GPU (front) and CPU (back) paths finish.
    for (uint32_t i : {5u, 0u, 4u, 1u, 3u, 2u}) {
      absl::SleepFor(absl::Milliseconds(5));
      channel.MarkSubgroupDone(i, seq);
    }
    absl::SleepFor(absl::Milliseconds(50));
    channel.MarkAllDone(seq, kMaxTrackedSubgroups + 8);  // a shard of that many subgroups
    channel.PostResult(seq);
    return 0;
  });
  ASSERT_TRUE(client.WaitSubgroups(3, 5, seq, kLong).ok());
  for (uint32_t i = 3; i <= 5; ++i) EXPECT_EQ(client.DoneWord(i)->load(), seq);
  // Past the tracked words: released only by MarkAllDone.
  EXPECT_NE(client.DoneWord(kMaxTrackedSubgroups + 7)->load(), seq);
  ASSERT_TRUE(client.WaitSubgroups(0, kMaxTrackedSubgroups + 7, seq, kLong).ok());
  EXPECT_EQ(client.DoneWord(kMaxTrackedSubgroups + 7)->load(), seq);
  ASSERT_TRUE(client.WaitResult(seq, kLong).ok());
  EXPECT_EQ(WaitExit(daemon), 0);
}

TEST_F(ControlChannelTest, SubgroupWaitReportsAClosedSession) {
  ControlBlockChannel client(block_);
  const uint32_t seq = client.PublishRequest();
  ControlBlockChannel(block_).Close();
  absl::Status st = client.WaitSubgroups(0, 0, seq, kLong);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("closed"));
}

// Gradients scaled in place (protocol 10): the trainer stores its stop and
// then reads whether a copy began; dosd stores that a copy begins and then
// reads the stop. Whatever the interleaving, dosd never copies a gradient
// the trainer goes on to write without waiting (Dekker's condition: at least
// one of the two sees the other's store).
TEST_F(ControlChannelTest, AStoppedCaptureIsNeverCopiedUnseenByTheTrainer) {
  ControlBlockChannel trainer(block_), daemon(block_);
  // In order: a copy begun first is seen; a stop first is seen.
  EXPECT_TRUE(daemon.BeginCapture(1));
  trainer.StopCaptures(1);
  EXPECT_TRUE(trainer.CaptureInFlight(1));
  daemon.EndCapture();
  EXPECT_FALSE(trainer.CaptureInFlight(1));
  EXPECT_FALSE(daemon.BeginCapture(1));
  EXPECT_FALSE(trainer.CaptureInFlight(2));  // another step's copy is not this one's
  EXPECT_TRUE(daemon.BeginCapture(2));
  daemon.EndCapture();

  // Raced: each round both sides start together, and the copy lasts until
  // the trainer has looked (one that ended before needs no wait).
  constexpr uint32_t kRounds = 20000;
  std::atomic<uint32_t> go{0}, ready{0}, looked{0};
  std::vector<uint8_t> copied(kRounds + 3), waited(kRounds + 3);
  std::thread dosd([&] {
    for (uint32_t seq = 3; seq < kRounds + 3; ++seq) {
      ready.fetch_add(1);
      while (go.load() != seq) std::this_thread::yield();
      copied[seq] = daemon.BeginCapture(seq) ? 1 : 0;
      while (looked.load() != seq) std::this_thread::yield();
      daemon.EndCapture();
    }
  });
  for (uint32_t seq = 3; seq < kRounds + 3; ++seq) {
    while (ready.load() != seq - 2) std::this_thread::yield();
    go.store(seq);
    trainer.StopCaptures(seq);
    waited[seq] = trainer.CaptureInFlight(seq) ? 1 : 0;
    looked.store(seq);
  }
  dosd.join();
  uint32_t unseen = 0;
  for (uint32_t seq = 3; seq < kRounds + 3; ++seq) unseen += copied[seq] && !waited[seq] ? 1 : 0;
  EXPECT_EQ(unseen, 0u);
}

}  // namespace
}  // namespace dos
