// The delayed host path's buffers (DelayedHost) against --host_memory_limit:
// a session's delayed steps charge them to the HostMemoryBudget its
// optimizer state is charged to, and the session gives them back with its
// DelayedHost (TakeShard, the session's end); a delayed step they would take
// past the limit fails with RESOURCE_EXHAUSTED naming the bytes, the limit
// and the fix, allocates and applies nothing, and the exact step after it
// gives what it gives on a session that never tried.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/session/session.h"
#include "tests/unit/session/session_fixture.h"

namespace dos {
namespace {

// One region per delayed subgroup, sized for the largest subgroup (1000
// elements): fp32 gradients and fp32 weights.
constexpr uint64_t kRegionBytes = 1000 * (4 + 4);
// Host sessions (HostSpec) put all four subgroups on the delayed path.
constexpr uint32_t kSubgroups = 4;

uint64_t StateBytes() { return ShardState::AllocatedBytes(kTotal, 1000, StateFormat::kFp32); }

std::vector<float> StateOf(ShardState& shard) {
  std::vector<float> all;
  for (uint32_t t = 0; t < shard.tensors().size(); ++t) {
    for (int which = 0; which < 3; ++which) {  // master, exp_avg, exp_avg_sq
      std::vector<float> v(shard.tensors()[t].numel);
      shard.ReadTensor(t, which, v.data());
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  return all;
}

class SessionDelayedTest : public SessionFixture {};

TEST_F(SessionDelayedTest, TheBuffersAreChargedWithTheStateAndGivenBackWithTheDelayedPath) {
  auto s = NewSession("cpu");
  ASSERT_TRUE(s->Register(HostSpec(*s)).ok());
  const uint64_t state = budget_.used();
  EXPECT_EQ(state, StateBytes());
  StepResult r = Step(*s, 1e-8, kStepDelayHost);
  ASSERT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(r.delayed_subgroups, kSubgroups);
  EXPECT_EQ(budget_.used(), state + kSubgroups * kRegionBytes);
  // Later steps reuse the buffers, exact ones keep them for the next delay.
  for (uint32_t flags : std::vector<uint32_t>{kStepDelayHost, 0, kStepDelayHost}) {
    r = Step(*s, 1e-8, flags);
    ASSERT_EQ(r.status_code, 0) << r.message;
    EXPECT_EQ(budget_.used(), state + kSubgroups * kRegionBytes) << flags;
  }
  // A second session's buffers are its own, given back when it ends.
  auto other = NewSession("cpu");
  ASSERT_TRUE(other->Register(HostSpec(*other)).ok());
  ASSERT_EQ(Step(*other, 1e-8, kStepDelayHost).status_code, 0);
  EXPECT_EQ(budget_.used(), 2 * (state + kSubgroups * kRegionBytes));
  other.reset();
  EXPECT_EQ(budget_.used(), state + kSubgroups * kRegionBytes);
  // The state leaves without its buffers (a resume adopts the shard alone),
  // and takes its own charge along.
  s->Stop();
  std::unique_ptr<ShardState> shard = s->TakeShard();
  EXPECT_EQ(budget_.used(), state);
  shard.reset();
  EXPECT_EQ(budget_.used(), 0u);
}

// Room for two sessions' state and two and a half buffers: a delayed step
// of one session needs four.
class SessionDelayedLimitTest : public SessionFixture {
 protected:
  static constexpr uint64_t kLimit = 2 * 12288 * 4 + 5 * kRegionBytes / 2;
  SessionDelayedLimitTest()
      : SessionFixture(OneResidentSubgroup(), FakeEngine::Options{.gpu = true}, kLimit) {}
};

TEST_F(SessionDelayedLimitTest, ADelayedStepPastTheLimitFailsCleanlyAndTheExactStepRuns) {
  ASSERT_EQ(kLimit, 2 * StateBytes() + 5 * kRegionBytes / 2);
  // The reference: a session of the same tensors that only steps exactly.
  auto ref = NewSession("cpu");
  ASSERT_TRUE(ref->Register(HostSpec(*ref)).ok());
  const std::unique_ptr<ShmSegment> ref_memory = std::move(shm_);
  auto s = NewSession("cpu");
  ASSERT_TRUE(s->Register(HostSpec(*s)).ok());
  const uint64_t states = budget_.used();
  ASSERT_EQ(states, 2 * StateBytes());

  StepResult r = Step(*s, 1e-8, kStepDelayHost);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kResourceExhausted)) << r.message;
  const std::string msg = r.message;
  for (const std::string& part :
       {std::string("this delayed step needs 31.25 KiB (32000 bytes) of host memory for the "
                    "delayed update's capture buffers (4 more, 7.81 KiB each"),
        std::string("of the daemon's 115.53 KiB limit is in use"),
        std::string("raise dosd --host_memory_limit"), std::string("delay=0"),
        std::string("this step applied nothing")}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " not in: " << msg;
  }
  // Nothing allocated or charged, nothing written, no step counted.
  EXPECT_EQ(budget_.used(), states);
  EXPECT_EQ(s->stats().failed_steps, 1u);
  EXPECT_EQ(std::memcmp(shm_->data(), params_.data(), 4 * kTotal), 0);

  // The exact step after it is the reference's first, bit for bit.
  r = Step(*s);
  ASSERT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(r.step, 1);
  r = Step(*ref);
  ASSERT_EQ(r.status_code, 0) << r.message;
  EXPECT_NE(std::memcmp(shm_->data(), params_.data(), 4 * kTotal), 0);  // it did step
  EXPECT_EQ(std::memcmp(shm_->data(), ref_memory->data(), 4 * kTotal), 0);
  EXPECT_EQ(budget_.used(), states);  // an exact step needs no buffers
  s->Stop();
  ref->Stop();
  std::unique_ptr<ShardState> got = s->TakeShard(), want = ref->TakeShard();
  EXPECT_EQ(got->tensors()[0].step, 1);
  EXPECT_EQ(StateOf(*got), StateOf(*want));
}

// --delayed_handoff through a session: a trainer that begins each early
// delayed step at once after the last result, while the update (four
// subgroups of 30 ms each on the fake engine) still runs, and gives its
// verdict 50 ms later. Its weights after every step and its state after
// kStepFinishDelayed are those of the same steps on the host engine, where
// nothing is handed off, bit for bit; and a reader of the state that asks
// meanwhile (ExportStateMemory) gets in at an update's end while the
// trainer keeps stepping, not after its last step.
class SessionHandOffTest : public SessionFixture {
 protected:
  static PlannerOptions HandOff() {
    PlannerOptions planner = OneResidentSubgroup();
    planner.delayed_handoff = true;
    return planner;
  }
  SessionHandOffTest()
      : SessionFixture(HandOff(), FakeEngine::Options{.gpu = true, .slow_update_ms = 30}) {}

  // Early delayed steps through `s`'s control block, a verdict 50 ms after
  // each begin; `each` after every result.
  // Without `finish` the trainer then begins one more step and goes away
  // before its verdict (what a killed trainer leaves).
  static void Train(Session& s, int steps, const std::function<void(int)>& each,
                    bool finish = true) {
    std::unique_ptr<ShmSegment> seg =
        *ShmSegment::Adopt(UniqueFd(fcntl(s.control_fd(), F_DUPFD_CLOEXEC, 0)), "control block");
    auto* block = static_cast<ControlBlock*>(seg->data());
    ControlBlockChannel channel(block);
    auto fill = [](StepRequest& r, uint32_t flags) {
      r = StepRequest{};
      r.flags = flags;
      r.num_groups = 1;
      r.grad_scale = 1;
      r.clip_coef = 1;
      r.groups[0] = Hyper();
    };
    for (int i = 0; i < steps; ++i) {
      fill(block->request, kStepGradientsPending | kStepDelayHost);
      const uint32_t seq = channel.PublishRequest();
      for (uint32_t sg = 0; sg < kMaxTrackedSubgroups; ++sg) channel.MarkReady(sg, seq);
      absl::SleepFor(absl::Milliseconds(50));
      fill(block->verdict, 0);
      block->verdict.seq = seq;
      channel.PublishVerdict(seq);
      ASSERT_TRUE(channel.WaitResult(seq, absl::Seconds(30)).ok());
      ASSERT_EQ(block->result.status_code, 0) << block->result.message;
      each(i);
    }
    if (!finish) {
      fill(block->request, kStepGradientsPending | kStepDelayHost);
      const uint32_t seq = channel.PublishRequest();
      for (uint32_t sg = 0; sg < kMaxTrackedSubgroups; ++sg) channel.MarkReady(sg, seq);
      return;
    }
    fill(block->request, kStepFinishDelayed);
    const uint32_t seq = channel.PublishRequest();
    ASSERT_TRUE(channel.WaitResult(seq, absl::Seconds(30)).ok());
    ASSERT_EQ(block->result.status_code, 0) << block->result.message;
  }
};

TEST_F(SessionHandOffTest, HandedOffUpdatesChangeNoBitAndLetAReaderIn) {
  constexpr int kSteps = 8;
  auto ref = NewSession("cpu");
  ASSERT_TRUE(ref->Register(HostSpec(*ref)).ok());
  std::vector<std::vector<float>> want;
  Train(*ref, kSteps, [&](int) {
    const float* w = static_cast<const float*>(shm_->data());
    want.emplace_back(w, w + kTotal);
  });
  auto s = NewSession("cpu");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  std::atomic<int> read_after{-1}, step{0};
  std::thread reader;
  Train(*s, kSteps, [&](int i) {
    EXPECT_EQ(std::vector<float>(params_.begin(), params_.end()), want[i]) << "step " << i + 1;
    step = i + 1;
    if (i == 1) {
      reader = std::thread([&] {
        EXPECT_TRUE(s->ExportStateMemory().ok());
        read_after = step.load();
      });
    }
  });
  reader.join();
  EXPECT_GE(read_after.load(), 2);
  EXPECT_LT(read_after.load(), kSteps) << "the reader waited for the trainer's last step";
  s->Stop();
  ref->Stop();
  std::unique_ptr<ShardState> got = s->TakeShard(), exp = ref->TakeShard();
  EXPECT_EQ(got->tensors()[0].step, kSteps);
  EXPECT_EQ(StateOf(*got), StateOf(*exp));
}

// A trainer that goes away inside an early step that took a hand-off (no
// verdict will come): the session's end joins the update, and the state it
// leaves is the last whole step's, bit for bit. dosd's debug lines say the
// last update was the abandoned step's hand-off.
TEST_F(SessionHandOffTest, ATrainerGoneWithAnUpdateHandedOffLeavesTheLastWholeStep) {
  constexpr int kSteps = 3;
  auto ref = NewSession("cpu");
  ASSERT_TRUE(ref->Register(HostSpec(*ref)).ok());
  Train(*ref, kSteps, [](int) {});
  auto s = NewSession("cpu");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  SetMinLogLevel(LogLevel::kDebug);
  ::testing::internal::CaptureStderr();
  Train(
      *s, kSteps, [](int) {}, /*finish=*/false);
  absl::SleepFor(absl::Milliseconds(20));  // the step has begun beside the update
  const absl::Time stop = absl::Now();
  s->Stop();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(5)) << "the session's end waited for a verdict";
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetMinLogLevel(LogLevel::kInfo);
  std::string last_update;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "event=delayed.update ")) last_update = std::string(line);
  }
  EXPECT_TRUE(absl::StrContains(last_update, "handed_off=true")) << log;
  ref->Stop();
  std::unique_ptr<ShardState> got = s->TakeShard(), exp = ref->TakeShard();
  EXPECT_EQ(got->tensors()[0].step, kSteps);
  EXPECT_EQ(StateOf(*got), StateOf(*exp));
}

// The state memory handed to the trainer (state_dict()'s views) stays charged
// after its session ends while the trainer still maps it: its bytes to the
// budget and, with dosd's shared ledger, one state view to its uid. A session
// with a ledger of its own (which dies with it) charges no view.
TEST_F(SessionDelayedTest, StateMemoryStillMappedStaysChargedAfterItsSession) {
  for (bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared ledger" : "the session's own ledger");
    ledger_ = shared ? &shared_ledger_ : nullptr;
    auto s = NewSession("cpu");
    ASSERT_TRUE(s->Register(HostSpec(*s)).ok());
    const uint64_t state = budget_.used();
    const uint32_t uid = s->identity().uid;
    absl::StatusOr<ShardState::StateMemory> m = s->ExportStateMemory();
    ASSERT_TRUE(m.ok()) << m.status();
    auto views = [&] {
      auto snap = shared_ledger_.Snapshot();
      auto it = snap.find(uid);
      return it == snap.end() ? uint64_t{0}
                              : it->second.used[static_cast<int>(UidResource::kStateViews)];
    };
    EXPECT_EQ(views(), shared ? 1u : 0u);
    struct stat st {};
    ASSERT_EQ(::fstat(m->state.get(), &st), 0);
    void* view =
        ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, m->state.get(), 0);
    ASSERT_NE(view, MAP_FAILED);
    m->state.reset();
    s->Stop();
    s.reset();
    budget_.ReapViews();
    EXPECT_EQ(budget_.used(), state) << "still mapped";
    EXPECT_EQ(budget_.viewed().shards, 1u);
    EXPECT_EQ(views(), shared ? 1u : 0u);
    ::munmap(view, static_cast<size_t>(st.st_size));
    budget_.ReapViews();
    EXPECT_EQ(budget_.used(), 0u);
    EXPECT_EQ(views(), 0u);
  }
}

}  // namespace
}  // namespace dos
