// A hostile or careless trainer writing its control block (dos/wire/
// control_block.h) by hand, on the host engine as CI runs it: any field at
// any value is refused with an error naming the field, a racing writer never
// gets an unchecked value applied, and protocol 5's early steps survive a
// verdict that never comes (alive or dead), comes for another seq, comes
// twice, or abandons a step that cannot be abandoned; another session on the
// same engine keeps stepping meanwhile.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "daemon/session/session.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"
#include "tests/unit/session/session_fixture.h"

namespace dos {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kInvalid = static_cast<int>(absl::StatusCode::kInvalidArgument);

// The trainer's side of a session's control block, written by hand.
struct Trainer {
  explicit Trainer(Session& s)
      : seg(*ShmSegment::Adopt(UniqueFd(fcntl(s.control_fd(), F_DUPFD_CLOEXEC, 0)), "control")),
        block(static_cast<ControlBlock*>(seg->data())),
        channel(block) {}

  // A valid request; `mutate` then writes what it likes.
  uint32_t Begin(uint32_t flags = 0, const std::function<void(StepRequest&)>& mutate = {}) {
    StepRequest& r = block->request;
    r.flags = flags;
    r.num_groups = 1;
    r.grad_scale = 1;
    r.clip_coef = 1;
    r.groups[0] = Hyper();
    if (mutate) mutate(r);
    return channel.PublishRequest();
  }
  void Verdict(uint32_t bell, uint32_t seq, uint32_t flags = 0) {
    StepRequest& v = block->verdict;
    v = StepRequest{};
    v.seq = seq;
    v.flags = flags;
    v.num_groups = 1;
    v.grad_scale = 1;
    v.clip_coef = 1;
    v.groups[0] = Hyper();
    channel.PublishVerdict(bell);
  }
  void MarkAllReady(uint32_t seq) {
    for (uint32_t i = 0; i < kMaxTrackedSubgroups; ++i) channel.MarkReady(i, seq);
  }
  // The result of `seq`; status_code -1 when none came within `timeout`.
  StepResult Wait(uint32_t seq, absl::Duration timeout = absl::Seconds(30)) {
    StepResult r{};
    r.status_code = -1;
    if (channel.WaitResult(seq, timeout).ok()) r = block->result;
    return r;
  }
  StepResult Step(uint32_t flags = 0, const std::function<void(StepRequest&)>& mutate = {}) {
    return Wait(Begin(flags, mutate));
  }

  std::unique_ptr<ShmSegment> seg;
  ControlBlock* block;
  ControlBlockChannel channel;
};

bool AllFinite(const ShmSegment& seg) {
  const float* w = static_cast<const float*>(seg.data());
  for (uint64_t i = 0; i < kTotal; ++i) {
    if (!std::isfinite(w[i])) return false;
  }
  return true;
}

class SessionHostileTest : public SessionFixture {
 protected:
  // A registered host-engine session and its weights' memory.
  std::unique_ptr<Session> HostSession(std::unique_ptr<ShmSegment>* weights, int32_t pid = getpid(),
                                       std::function<void(uint64_t)> gone = nullptr) {
    auto s = NewSession("auto", pid, std::move(gone));
    EXPECT_TRUE(s->Register(HostSpec(*s)).ok());
    *weights = std::move(shm_);
    return s;
  }
};

struct Garbage {
  const char* what;     // the field the error must name
  std::function<void(StepRequest&)> write;
};

TEST_F(SessionHostileTest, EveryFieldAtAnyValueIsRefusedNamingItAndTheNextStepRuns) {
  std::unique_ptr<ShmSegment> weights, other_weights;
  auto s = HostSession(&weights);
  auto other = HostSession(&other_weights);
  Trainer t(*s), o(*other);
  const std::vector<Garbage> garbage = {
      {"param groups", [](StepRequest& r) { r.num_groups = 0; }},
      {"param groups", [](StepRequest& r) { r.num_groups = kMaxGroups + 1; }},
      {"param groups", [](StepRequest& r) { r.num_groups = ~0u; }},
      {"grad_scale", [](StepRequest& r) { r.grad_scale = kNaN; }},
      {"grad_scale", [](StepRequest& r) { r.grad_scale = kInf; }},
      {"grad_scale", [](StepRequest& r) { r.grad_scale = -1; }},
      {"grad_scale", [](StepRequest& r) { r.grad_scale = 0; }},
      {"clip_coef", [](StepRequest& r) { r.clip_coef = kNaN; }},
      {"clip_coef", [](StepRequest& r) { r.clip_coef = -kInf; }},
      {"clip_coef", [](StepRequest& r) { r.clip_coef = -1e300; }},
      {"lr", [](StepRequest& r) { r.groups[0].lr = kNaN; }},
      {"lr", [](StepRequest& r) { r.groups[0].lr = kInf; }},
      {"lr", [](StepRequest& r) { r.groups[0].lr = -1; }},
      {"beta1", [](StepRequest& r) { r.groups[0].beta1 = kNaN; }},
      {"beta1", [](StepRequest& r) { r.groups[0].beta1 = 1; }},
      {"beta2", [](StepRequest& r) { r.groups[0].beta2 = -kInf; }},
      {"eps", [](StepRequest& r) { r.groups[0].eps = kNaN; }},
      {"eps", [](StepRequest& r) { r.groups[0].eps = -1e-8; }},
      {"weight_decay", [](StepRequest& r) { r.groups[0].weight_decay = kInf; }},
      {"flags", [](StepRequest& r) { r.flags = 1u << 31; }},
      {"flags", [](StepRequest& r) { r.flags = ~0u; }},
      {"kStepAbandon", [](StepRequest& r) { r.flags = kStepAbandon; }},
      {"kStepNoVerdict", [](StepRequest& r) { r.flags = kStepNoVerdict | kStepGradientsChecked; }},
      {"kStepGradientsChecked",
       [](StepRequest& r) { r.flags = kStepGradientsPending | kStepNoVerdict; }},
      {"kStepTrainerEventRecorded", [](StepRequest& r) { r.flags = kStepTrainerEventRecorded; }},
  };
  for (const Garbage& g : garbage) {
    const StepResult r = t.Step(0, g.write);
    EXPECT_EQ(r.status_code, kInvalid) << g.what << ": " << r.message;
    EXPECT_NE(std::string(r.message).find(g.what), std::string::npos) << r.message;
    // The other session never notices.
    EXPECT_EQ(o.Step().status_code, 0);
  }
  // The seq field the trainer writes is its own business: dosd answers the bell.
  const StepResult seq = t.Step(0, [](StepRequest& r) { r.seq = 12345; });
  EXPECT_EQ(seq.status_code, 0) << seq.message;
  EXPECT_EQ(seq.step, 1);  // nothing refused above was applied
  EXPECT_TRUE(AllFinite(*weights));
  EXPECT_EQ(s->stats().failed_steps, garbage.size());
  EXPECT_EQ(other->stats().steps, garbage.size());
}

TEST_F(SessionHostileTest, LeaseNumbersOfAnySizeAreHarmlessOnTheHostEngine) {
  std::unique_ptr<ShmSegment> weights;
  auto s = HostSession(&weights);
  Trainer t(*s);
  const uint64_t values[] = {0, 1, ~uint64_t{0}, uint64_t{1} << 63, 80ull << 30};
  int i = 0;
  for (uint64_t lease : values) {
    for (uint64_t budget : values) {
      // A different lease every step, the budget and peak at random.
      const StepResult r = t.Step(kStepGpuLease, [&](StepRequest& q) {
        q.gpu_lease_bytes = lease;
        q.gpu_budget_bytes = budget;
        q.gpu_peak_bytes = values[i % 5];
      });
      ++i;
      ASSERT_EQ(r.status_code, 0) << r.message;
      EXPECT_EQ(t.block->lease_bell.load(), r.seq);
    }
  }
  EXPECT_EQ(s->stats().last.resident_subgroups, 0u);
  EXPECT_EQ(s->stats().last.gpu_subgroups, 0u);
  EXPECT_EQ(s->stats().steps, 25u);
  EXPECT_TRUE(AllFinite(*weights));
}

// The trainer writes its block at any time, also while dosd reads it: what
// dosd checked is what it applies (one copy of the request per step).
TEST_F(SessionHostileTest, ARacingWriterNeverGetsAnUncheckedValueApplied) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a deliberate data race with dosd's reader (the attack itself)";
#endif
  std::unique_ptr<ShmSegment> weights;
  auto s = HostSession(&weights);
  Trainer t(*s);
  ASSERT_EQ(t.Step().status_code, 0);  // a valid request in the block
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    volatile double* lr = &t.block->request.groups[0].lr;
    volatile double* scale = &t.block->request.grad_scale;
    for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      *lr = (i & 1) ? kNaN : 1e-2;
      *scale = (i & 2) ? -1.0 : 1.0;
    }
  });
  int ok = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    const StepResult r = t.Wait(t.channel.PublishRequest());
    if (r.status_code == 0) {
      ++ok;
    } else {
      ASSERT_EQ(r.status_code, kInvalid) << r.message;
      ++refused;
    }
  }
  stop = true;
  writer.join();
  EXPECT_TRUE(AllFinite(*weights)) << ok << " steps applied, " << refused << " refused";
}

class EarlyStepTest : public SessionHostileTest {
 protected:
  EarlyStepTest() { early_ready_timeout_ = absl::Milliseconds(300); }
};

TEST_F(EarlyStepTest, AVerdictThatNeverComesFailsTheStepAndTheOtherSessionSteps) {
  std::unique_ptr<ShmSegment> weights, other_weights;
  auto s = HostSession(&weights);
  auto other = HostSession(&other_weights);
  Trainer t(*s), o(*other);
  const absl::Time begun = absl::Now();
  const uint32_t seq = t.Begin(kStepGradientsPending);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(o.Step().status_code, 0);
  const StepResult r = t.Wait(seq);
  EXPECT_GE(absl::Now() - begun, absl::Milliseconds(300));
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << r.message;
  EXPECT_NE(std::string(r.message).find("no verdict for early step"), std::string::npos)
      << r.message;
  EXPECT_NE(std::string(r.message).find("--early_step_ready_timeout"), std::string::npos);
  // A verdict now, late, is for a step that is over: the next step runs alone.
  t.Verdict(seq, seq);
  const StepResult next = t.Step();
  EXPECT_EQ(next.status_code, 0) << next.message;
  EXPECT_EQ(next.step, 1);
  // The same for a step without a verdict whose ready words never come.
  const uint32_t nv = t.Begin(kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked);
  EXPECT_EQ(o.Step().status_code, 0);
  EXPECT_EQ(t.Wait(nv).status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(t.Step().step, 2);
}

TEST_F(EarlyStepTest, AVerdictForAnotherSeqIsRefusedNamingIt) {
  early_ready_timeout_ = absl::Minutes(10);  // refused at once, not at the deadline
  std::unique_ptr<ShmSegment> weights;
  auto s = HostSession(&weights);
  Trainer t(*s);
  // The bell rung past the step's seq.
  uint32_t seq = t.Begin(kStepGradientsPending);
  t.Verdict(seq + 5, seq + 5);
  StepResult r = t.Wait(seq, absl::Seconds(20));
  EXPECT_EQ(r.status_code, kInvalid) << r.message;
  EXPECT_NE(std::string(r.message).find("verdict_bell was rung for seq"), std::string::npos)
      << r.message;
  // The bell right, the verdict's own seq wrong (the bell first put back
  // behind the next step, as a trainer may).
  t.block->verdict_bell.store(seq);
  seq = t.Begin(kStepGradientsPending);
  t.Verdict(seq, seq + 7);
  r = t.Wait(seq, absl::Seconds(20));
  EXPECT_EQ(r.status_code, kInvalid) << r.message;
  EXPECT_NE(std::string(r.message).find("verdict carries seq"), std::string::npos) << r.message;
  // Garbage in the verdict is refused as in a request.
  seq = t.Begin(kStepGradientsPending);
  t.Verdict(seq, seq, 1u << 30);
  r = t.Wait(seq, absl::Seconds(20));
  EXPECT_EQ(r.status_code, kInvalid) << r.message;
  EXPECT_NE(std::string(r.message).find("verdict flags"), std::string::npos) << r.message;
  EXPECT_EQ(t.Step().step, 1);
  EXPECT_TRUE(AllFinite(*weights));
}

TEST_F(EarlyStepTest, AbandonAndTwiceRungVerdictsApplyNothingTheyShouldNot) {
  std::unique_ptr<ShmSegment> weights;
  auto s = HostSession(&weights);
  Trainer t(*s);
  // Abandoned: nothing applied.
  uint32_t seq = t.Begin(kStepGradientsPending);
  t.Verdict(seq, seq, kStepAbandon);
  StepResult r = t.Wait(seq);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kAborted)) << r.message;
  // A verdict (an abandon) on a step without one is ignored (only a skip
  // mask alone is taken there): its ready words decide, and the step is
  // applied whole.
  seq = t.Begin(kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked);
  t.Verdict(seq, seq, kStepAbandon);
  t.MarkAllReady(seq);
  r = t.Wait(seq);
  EXPECT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(r.step, 1);
  // A verdict rung twice: the second (same seq) is stale for the next early
  // step, which waits for its own and gives up at the deadline.
  seq = t.Begin(kStepGradientsPending);
  t.Verdict(seq, seq);
  EXPECT_EQ(t.Wait(seq).step, 2);
  t.Verdict(seq, seq);
  const uint32_t next = t.Begin(kStepGradientsPending);
  r = t.Wait(next);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << r.message;
  EXPECT_EQ(t.Step().step, 3);
  EXPECT_TRUE(AllFinite(*weights));
}

TEST_F(EarlyStepTest, ATrainerThatDiesBeforeItsVerdictIsReaped) {
  early_ready_timeout_ = absl::Minutes(10);  // the death is seen, not the deadline
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_GT(child, 0);
  absl::Notification gone;
  std::unique_ptr<ShmSegment> weights, other_weights;
  auto s = HostSession(&weights, child, [&](uint64_t) { gone.Notify(); });
  auto other = HostSession(&other_weights);
  Trainer t(*s), o(*other);
  const uint32_t seq = t.Begin(kStepGradientsPending);
  EXPECT_EQ(o.Step().status_code, 0);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  const StepResult r = t.Wait(seq);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kUnavailable)) << r.message;
  EXPECT_NE(std::string(r.message).find("is gone while dosd waited for the step's verdict"),
            std::string::npos)
      << r.message;
  EXPECT_TRUE(gone.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(o.Step().status_code, 0);
  s->Stop();
}

}  // namespace
}  // namespace dos
