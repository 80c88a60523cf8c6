// Session's step flow on fake engines, in CI without a GPU: registration
// picks the executor (engine and planner) of the tensors' memory, steps go
// through the control block to the engine's Execute, faults at the engine
// and transport seams come back as errors that leave the session usable, the
// hyperparameter rules hold at registration and at every step (eps = 0
// included), a zombie trainer counts as gone, and a dead trainer's
// session no longer shares its GPU.
#include "daemon/session/session.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/sched/executor_set.h"
#include "daemon/session/session_manager.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"
#include "tests/unit/session/session_fixture.h"

namespace dos {
namespace {

class SessionTest : public SessionFixture {};

TEST_F(SessionTest, GpuModeStepsRunTheDevicesPlanOnItsEngine) {
  auto s = NewSession("interleave:2");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  EXPECT_EQ(gpu_.attached(), 1);
  EXPECT_EQ(s->summary().gpu_device, 0);
  EXPECT_EQ(s->summary().gpu_uuid, kUuid);
  StepResult r = Step(*s);
  EXPECT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(r.step, 1);
  ASSERT_EQ(gpu_.plans().size(), 1u);
  const StepPlan plan = gpu_.plans()[0];
  EXPECT_EQ(plan.num_subgroups, 4u);
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(plan.cpu_only, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(gpu_.done_subgroups().size(), 4u);
  SessionStatsSnapshot st = s->stats();
  EXPECT_EQ(st.last.gpu_subgroups, 2u);
  EXPECT_EQ(st.last.cpu_subgroups, 2u);
  EXPECT_GT(st.last.predicted_us, 0);
  // A policy set later reaches the next plan.
  s->SetPolicy(*ParsePolicy("auto"));
  Step(*s);
  EXPECT_EQ(gpu_.plans().back().resident, 1u);
}

TEST_F(SessionTest, HostAndGpuModeGiveTheSameStateBitForBit) {
  auto host = NewSession("auto");
  ASSERT_TRUE(host->Register(HostSpec(*host)).ok());
  EXPECT_EQ(host->summary().gpu_device, -1);
  auto dev = NewSession("auto");
  ASSERT_TRUE(dev->Register(DeviceSpec()).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Step(*host).status_code, 0);
    EXPECT_EQ(Step(*dev).status_code, 0);
  }
  EXPECT_EQ(std::memcmp(shm_->data(), params_.data(), 4 * kTotal), 0);
  EXPECT_EQ(host->stats().last.cpu_subgroups, 4u);
  EXPECT_EQ(host->stats().last.predicted_us, 0);  // GPU-mode fields stay zero on the host
}

TEST_F(SessionTest, AnEngineErrorMidStepIsReportedAndTheNextStepRuns) {
  auto s = NewSession("cpu");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  gpu_.FailExecuteAfter(2, absl::InternalError("fake: copy engine fault"));
  StepResult r = Step(*s);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kInternal));
  EXPECT_NE(std::string(r.message).find("copy engine fault"), std::string::npos) << r.message;
  EXPECT_EQ(s->stats().failed_steps, 1u);
  gpu_.FailExecuteAfter(0, absl::OkStatus());
  r = Step(*s);
  EXPECT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(r.step, 1);  // the failed step advanced no counter
}

TEST_F(SessionTest, AGradientScanErrorFailsTheStep) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  gpu_.FailAllFinite(absl::UnavailableError("fake: scan failed"));
  EXPECT_EQ(Step(*s).status_code, static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(gpu_.plans().empty());
}

TEST_F(SessionTest, ATransportThatFailsToMapRefusesRegistrationCleanly) {
  auto s = NewSession("auto");
  gpu_.FailMap(absl::UnavailableError("fake: cannot map"));
  absl::Status st = s->Register(DeviceSpec());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("tensor 0 (t0) param"), absl::string_view::npos) << st;
  EXPECT_FALSE(s->registered());
  EXPECT_EQ(gpu_.attached(), 0);
  // No step thread runs before a registration succeeds (an idle session costs
  // no thread), so there is no step to try here; the client library refuses
  // a step before registration itself.
  gpu_.FailMap(absl::OkStatus());
  EXPECT_TRUE(s->Register(DeviceSpec()).ok());
}

TEST_F(SessionTest, AnAttachFailureLeavesTheSessionUnregistered) {
  auto s = NewSession("auto");
  gpu_.FailAttach(absl::ResourceExhaustedError("fake: cannot page-lock"));
  EXPECT_EQ(s->Register(DeviceSpec()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(s->registered());
  EXPECT_EQ(budget_.used(), 0u);  // the state built for it was freed
}

// RegisterShard calls sent together on one session (a stalled step holding
// it) each held a thread and a copy of their request until the step let go;
// now one is admitted at a time, the others refused at once, and none once
// the shard is registered.
TEST_F(SessionTest, OneRegistrationAtATimeAndNoneOnceRegistered) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->BeginRegister().ok());
  absl::Status second = s->BeginRegister();
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.message().find("being registered by another RegisterShard call"),
            std::string::npos)
      << second;
  s->EndRegister();
  ASSERT_TRUE(s->BeginRegister().ok());  // a failed attempt is retried after its answer
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  s->EndRegister();
  absl::Status again = s->BeginRegister();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("already has a registered shard"), std::string::npos) << again;
}

TEST_F(SessionTest, TheTrainerEventIsOpenedAtRegistrationWaitedOnAndClosed) {
  {
    auto s = NewSession("auto");
    ShardSpec spec = DeviceSpec();
    spec.cuda_ipc_event = "event";
    ASSERT_TRUE(s->Register(spec).ok());
    EXPECT_EQ(gpu_.open_events(), 1);
    EXPECT_EQ(Step(*s, 1e-8, kStepTrainerEventRecorded).status_code, 0);
  }
  EXPECT_EQ(gpu_.open_events(), 0);
  auto s = NewSession("auto");
  ShardSpec spec = DeviceSpec();
  spec.cuda_ipc_event = "event";
  gpu_.FailOpenEvent(absl::InvalidArgumentError("fake: bad handle"));
  EXPECT_EQ(s->Register(spec).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_.open_events(), 0);
}

TEST_F(SessionTest, EpsZeroIsAcceptedAtRegistrationAndAtEveryStep) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(DeviceSpec(/*eps=*/0)).ok());
  for (int i = 1; i <= 3; ++i) {
    StepResult r = Step(*s, /*eps=*/0);
    EXPECT_EQ(r.status_code, 0) << r.message;
    EXPECT_EQ(r.step, i);
  }
}

TEST_F(SessionTest, HyperparametersOutsideTorchsRulesAreRefusedEverywhere) {
  auto s = NewSession("auto");
  ShardSpec spec = DeviceSpec(/*eps=*/-1e-8);
  absl::Status st = s->Register(spec);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("register: group 0 eps"), absl::string_view::npos) << st;
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  StepResult r = Step(*s, /*eps=*/-1);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(std::string(r.message).find("step: group 0 eps"), std::string::npos) << r.message;
}

TEST_F(SessionTest, AZombieTrainerCountsAsGone) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  // Not reaped yet: kill(child, 0) still succeeds on the zombie.
  // Unregistered, so no step thread watches it: SessionManager's reaper asks
  // ClientGoneWithoutThread() once a second.
  auto s = NewSession("auto", child);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!s->ClientGoneWithoutThread() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // polling a condition
  }
  EXPECT_TRUE(s->ClientGoneWithoutThread());
  s->Stop();
  waitpid(child, nullptr, 0);
}

// A session whose trainer died waits --session_lease for a resume, but
// takes no more turns on its GPU: the live session's steps no longer count
// it (a per-subgroup step would wait for all its gradients first, and the
// GPU's delayed update would stay off).
TEST_F(SessionTest, ADeadTrainersSessionNoLongerSharesItsGpu) {
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_GT(child, 0);
  auto live = NewSession("auto");
  ASSERT_TRUE(live->Register(DeviceSpec()).ok());
  absl::Notification gone;
  auto dead = NewSession("auto", child, [&](uint64_t) { gone.Notify(); });
  ASSERT_TRUE(dead->Register(DeviceSpec()).ok());
  StepPlanner& planner = executors_.ForDeviceUuid(kUuid, "test")->executor->planner();
  EXPECT_TRUE(planner.sessions().Shared(live->identity().id));
  EXPECT_TRUE(planner.sessions().Shared(dead->identity().id));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(gone.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_FALSE(planner.sessions().Shared(live->identity().id));
  EXPECT_EQ(Step(*live).status_code, 0);
  dead->Stop();
  EXPECT_FALSE(planner.sessions().Shared(live->identity().id));
}

// A control block still mapped after its session is gone stays charged to
// the uid (one kClosedBlocks, which the session manager counts as a session)
// until it is unmapped; a fetched descriptor closed unmapped holds nothing.
TEST_F(SessionTest, AControlBlockStillMappedAfterItsSessionStaysChargedToItsUid) {
  ledger_ = &shared_ledger_;
  auto s = NewSession("cpu");
  const uint32_t uid = s->identity().uid;
  auto closed = [&] { return shared_ledger_.Used(uid, UidResource::kClosedBlocks); };
  absl::StatusOr<UniqueFd> fd = s->ControlBlockFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(s->ControlBlockFd().ok());  // fetched and closed at once: maps nothing
  const size_t bytes = s->control_block_bytes();
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  fd->reset();  // the mapping alone keeps it
  s->Stop();
  s.reset();
  EXPECT_EQ(closed(), 1u);
  EXPECT_EQ(budget_.held_blocks(), 1u);
  budget_.ReapViews();
  EXPECT_EQ(closed(), 1u) << "still mapped";
  ::munmap(map, bytes);
  budget_.ReapViews();
  EXPECT_EQ(closed(), 0u);
  EXPECT_EQ(budget_.held_blocks(), 0u);

  auto t = NewSession("cpu");
  ASSERT_TRUE(t->ControlBlockFd().ok());
  t->Stop();
  t.reset();
  EXPECT_EQ(budget_.held_blocks(), 0u);
  EXPECT_EQ(closed(), 0u);
}

// The session caps are checked under the manager's lock, but a new session
// enters its table only after Session::Create, off the lock: attaches sent
// at once all passed the check. Those being created count now.
TEST_F(SessionTest, AttachesAtOnceStayWithinTheUidsSessionCap) {
  SessionOptions options;
  options.max_sessions_per_uid = 2;
  options.liveness_interval = absl::Milliseconds(10);
  SessionManager manager(options, *ParsePolicy("cpu"), &executors_, &budget_);
  std::atomic<int> attached{0}, refused{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&] {
      SessionIdentity id;
      id.pid = getpid();
      id.uid = 4242;
      absl::StatusOr<std::shared_ptr<Session>> s = manager.Attach(id);
      (s.ok() ? attached : refused).fetch_add(1);
      if (!s.ok()) {
        EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(attached.load(), 2);
  EXPECT_EQ(refused.load(), 14);
  EXPECT_EQ(manager.SessionsOf(4242), 2u);
}

// The descriptor server's hold on a session (HoldForPort) keeps it while a
// request is served; let go after a Detach, it hands the last reference to
// the reaper instead of freeing the state on the descriptor server's thread.
TEST_F(SessionTest, APortsLastHoldIsDroppedByTheReaperNotWhereItIsLetGo) {
  SessionOptions options;
  options.liveness_interval = absl::Milliseconds(10);
  SessionManager manager(options, *ParsePolicy("cpu"), &executors_, &budget_);
  SessionIdentity id;
  id.pid = getpid();
  id.uid = 4243;
  absl::StatusOr<std::shared_ptr<Session>> s = manager.Attach(id);
  ASSERT_TRUE(s.ok()) << s.status();
  std::weak_ptr<Session> weak = *s;
  std::shared_ptr<void> hold = manager.HoldForPort(*s);
  const SessionIdentity identity = (*s)->identity();
  s->reset();
  ASSERT_TRUE(manager.Detach(identity.id, identity.token).ok());
  EXPECT_FALSE(weak.expired()) << "the port still holds it";
  hold.reset();  // as the descriptor server does once the request is answered
  for (int i = 0; i < 500 && !weak.expired(); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(weak.expired()) << "the reaper drops it within its wake-up";
}

}  // namespace
}  // namespace dos
