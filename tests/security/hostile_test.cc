// A hostile trainer writing its own control block by hand (mem_client's
// raw_step, early_stall), as one of the fixture's users, beside another
// user's trainer on the same dosd: garbage in any field is refused naming the
// field, an early step whose verdict never comes fails at
// --early_step_ready_timeout, a trainer killed between begin and verdict is
// reaped, and the other user steps throughout.
#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"

namespace dos::testing {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kDeadlineExceeded = 4;
constexpr int kResourceExhausted = 8;

std::vector<std::string> MemArgv(const std::string& socket, std::vector<std::string> ops) {
  return ClientArgv(DOS_MEM_CLIENT_PATH, socket, std::move(ops));
}

struct Garbage {
  const char* op;
  const char* named;  // what dosd's message must name
};

TEST(Hostile, ControlBlockGarbageIsRefusedNamingTheFieldAndAnotherUserSteps) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::vector<Garbage> garbage = {
      {"raw_step:field=lr,value=nan", "lr = nan"},
      {"raw_step:field=lr,value=inf", "lr = inf"},
      {"raw_step:field=eps,value=-1", "eps = -1"},
      {"raw_step:field=grad_scale,value=0", "grad_scale = 0"},
      {"raw_step:field=grad_scale,value=-inf", "grad_scale = -inf"},
      {"raw_step:field=clip_coef,value=nan", "clip_coef = nan"},
      {"raw_step:field=num_groups,value=4294967295", "4294967295 param groups"},
      {"raw_step:field=flags,value=4294967295", "flags 0xffffffff"},
      {"raw_step:field=flags,value=32", "kStepAbandon"},
      {"raw_step:field=flags,value=16", "kStepNoVerdict"},
  };
  std::vector<std::string> ops = {"attach", "register:numel=4096"};
  for (const Garbage& g : garbage) ops.push_back(g.op);
  // Lease numbers of any size: harmless without a GPU.
  for (const char* lease : {"raw_step:field=lease,value=18446744073709551615",
                            "raw_step:field=budget,value=0", "raw_step:field=peak,value=1"}) {
    ops.push_back(lease);
  }
  ops.push_back("raw_step");
  ops.push_back("wait");
  UserProcess a(User("dos-sec-a"), MemArgv(d->socket(), ops));
  UserProcess e(User("dos-sec-e"),
                MemArgv(d->socket(), {"attach", "register:numel=4096", "step:n=30"}));
  for (const Garbage& g : garbage) {
    const std::string line = a.Await("raw_step", 60000);
    EXPECT_EQ(Code(line), kInvalidArgument) << g.op << ": " << line << a.output();
    EXPECT_NE(line.find(g.named), std::string::npos) << g.op << ": " << line;
  }
  for (int i = 0; i < 3; ++i) {
    const std::string line = a.Await("raw_step", 60000);
    EXPECT_EQ(Code(line), 0) << line;
  }
  const std::string valid = a.Await("raw_step", 60000);
  EXPECT_EQ(Code(valid), 0) << valid;
  EXPECT_EQ(Field(valid, "step"), "4") << valid;  // the three lease steps and this one
  const std::string other = e.Await("step", 60000);
  EXPECT_EQ(Code(other), 0) << other << e.output();
  EXPECT_EQ(Field(other, "step"), "30") << other;
  a.Finish();
  e.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

TEST(Hostile, AnEarlyStepWithoutItsVerdictNeitherHangsDosdNorHoldsUpAnotherUser) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--early_step_ready_timeout=5s"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess e(User("dos-sec-e"),
                MemArgv(d->socket(), {"attach", "register:numel=4096", "wait", "step:n=20"}));
  ASSERT_EQ(Code(e.Await("wait")), 0) << e.output() << d->log().substr(0, 4000);
  // One stalls alive, one is killed mid-step.
  UserProcess a(User("dos-sec-a"),
                MemArgv(d->socket(), {"attach", "register:numel=4096", "early_stall", "raw_wait",
                                      "raw_step"}));
  UserProcess b(User("dos-sec-b"),
                MemArgv(d->socket(), {"attach", "register:numel=4096", "early_stall", "wait"}));
  ASSERT_EQ(Code(a.Await("early_stall")), 0) << a.output() << d->log().substr(0, 4000);
  const auto stalled_at = std::chrono::steady_clock::now();
  ASSERT_EQ(Code(b.Await("early_stall")), 0) << b.output();
  b.Kill();
  // The other user steps while both wait (stdin closed: its ops go on).
  const std::string other = e.Finish(60000);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stalled_at).count();
  EXPECT_NE(other.find("OK step step=20"), std::string::npos) << other;
  EXPECT_LT(secs, 5.0) << "the other user's 20 steps ended " << secs << " s into the stall";
  const std::string stalled = a.Await("raw_wait", 60000);
  EXPECT_EQ(Code(stalled), kDeadlineExceeded) << stalled << a.output();
  EXPECT_NE(stalled.find("no verdict for early step"), std::string::npos) << stalled;
  const std::string after = a.Await("raw_step", 60000);
  EXPECT_EQ(Code(after), 0) << after;
  EXPECT_EQ(Field(after, "step"), "1") << after;  // the stalled step applied nothing
  EXPECT_TRUE(WaitFor([&] { return d->log().find("session.client_gone") != std::string::npos; },
                      30000))
      << d->log().substr(0, 4000);
  EXPECT_NE(d->log().find("is gone while dosd waited for the step's verdict"), std::string::npos)
      << d->log().substr(0, 4000);
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// The delayed host path (kStepDelayHost) under several accounts: a user
// whose capture buffers would pass --session_memory_limit is refused naming
// the flag and applies nothing (its next exact step is its first), a user
// killed with a delayed update pending is reaped, and a third user's plain
// steps run beside what is left; dosd then stops cleanly.
TEST(Hostile, DelayedStepsUnderSeveralAccountsAreIsolated) {
  DOS_SECURITY_REQUIRE();
  // 4M bf16 parameters: 48 MB of state plus 16 MB of capture buffers.
  auto d = SecureDaemon({"--session_memory_limit=60M"});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string delayed = "raw_step:field=flags,value=128";  // kStepDelayHost
  UserProcess a(User("dos-sec-a"),
                MemArgv(d->socket(), {"attach", "register:numel=4000000", delayed, "raw_step"}));
  UserProcess b(User("dos-sec-b"), MemArgv(d->socket(), {"attach", "register:numel=4096", delayed,
                                                         delayed, delayed, "wait"}));
  const std::string refused = a.Await("raw_step", 60000);
  EXPECT_EQ(Code(refused), kResourceExhausted) << refused << a.output();
  EXPECT_NE(refused.find("--session_memory_limit"), std::string::npos) << refused;
  EXPECT_NE(refused.find("delay=0"), std::string::npos) << refused;
  const std::string exact = a.Await("raw_step", 60000);
  EXPECT_EQ(Code(exact), 0) << exact;
  EXPECT_EQ(Field(exact, "step"), "1") << exact;  // the refused step applied nothing
  for (int i = 1; i <= 3; ++i) {
    const std::string line = b.Await("raw_step", 60000);
    EXPECT_EQ(Code(line), 0) << line << b.output();
    EXPECT_EQ(Field(line, "step"), std::to_string(i)) << line;
  }
  ASSERT_EQ(Code(b.Await("wait")), 0) << b.output();
  b.Kill();  // its last step's update ran after the result; nothing installed it
  UserProcess e(User("dos-sec-e"),
                MemArgv(d->socket(), {"attach", "register:numel=4096", "step:n=20"}));
  const std::string other = e.Finish(60000);
  EXPECT_NE(other.find("OK step step=20"), std::string::npos) << other;
  EXPECT_TRUE(
      WaitFor([&] { return d->log().find("session.client_gone") != std::string::npos; }, 30000))
      << d->log().substr(0, 4000);
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

}  // namespace
}  // namespace dos::testing
