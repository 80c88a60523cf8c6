// Issue 11, items 7, 9 and 11: honest accounting and bounded resources.
// Tiny subgroups cannot grow dosd past its accounting; a checkpoint keeps no
// copy of the state, which goes with its session; session caps; idle sessions cost no thread;
// attach floods from several users leave another user stepping; a memory refusal names the caller's
// own orphaned sessions, not other users'; SIGTERM with hundreds of sessions is quick; repeated
// failures are logged a few times with a count; metrics scrapes are not held up by idle
// connections; ImportState checks the step counter; a clean stop leaves no lock file.
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/security/security_env.h"
#include "tests/support/loopback.h"

namespace dos::testing {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kResourceExhausted = 8;

// A field of /proc/<pid>/status as a number ("VmRSS" in kB, "Threads").
long ProcStatus(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stol(line.substr(key.size() + 1));
  }
  return -1;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; at += what.size()) ++n;
  return n;
}

// Sessions dosd lists (attached or waiting for a resume), asked by a trainer
// of the group (the log is rate-limited: it does not count them).
int Listed(const DaemonProcess& d) {
  const std::string n = Field(RunAs(User("dos-sec-b"), d.socket(), {"rpc_list"}), "sessions");
  return n.empty() ? -1 : std::stoi(n);
}

// Lines of `event` left out of the log: the suppressed=N of its next line and
// of the log.suppressed line dosd writes at exit.
size_t Suppressed(const std::string& log, const std::string& event) {
  size_t n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("event=" + event + " ") == std::string::npos) continue;
    if (line.find("event=log.rate_limited") != std::string::npos) continue;  // says "=N"
    const std::string v = Field(line, "suppressed");
    n += v.empty() ? 0 : std::stoul(v);
  }
  return n;
}

TEST(Resources, TinySubgroupsCannotGrowDosdPastItsAccounting) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--session_memory_limit=16M"});
  ASSERT_TRUE(d->Start()) << d->log();
  const long before = ProcStatus(d->pid(), "VmRSS");
  // 100k parameters in subgroups of 1 would be 100k page-sized allocations
  // (400 MB) accounted as 1.2 MB.
  UserProcess a(User("dos-sec-a"), d->socket(),
                {"attach", "register:numel=100000,subgroup=1", "step", "wait"});
  const std::string reg = a.Await("register");
  ASSERT_EQ(Code(reg), 0) << reg << d->log();
  ASSERT_EQ(Code(a.Await("step")), 0) << a.output();
  const long grown_kb = ProcStatus(d->pid(), "VmRSS") - before;
  EXPECT_LT(grown_kb, 32 * 1024) << "dosd grew " << grown_kb << " kB for 1.2 MB of state";
  EXPECT_NE(d->log().find("session.subgroup_size_raised"), std::string::npos) << d->log();
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(Resources, ASaveKeepsNoCopyOfTheStateWhichGoesWithItsSession) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const long before = ProcStatus(d->pid(), "VmRSS");
  {
    // 4 Mi parameters: 48 MiB of state; a checkpoint saved by id is written
    // from it (dosd once kept a staging copy as large until the session
    // ended).
    UserProcess a(User("dos-sec-a"), d->socket(),
                  {"attach", "register:numel=4194304", "rpc_save:id=self", "wait"});
    ASSERT_EQ(Code(a.Await("rpc_save", 60000)), 0) << a.output() << d->log();
    ASSERT_EQ(Code(a.Await("wait")), 0);
    const long held = ProcStatus(d->pid(), "VmRSS") - before;
    EXPECT_GT(held, 40 * 1024);
    EXPECT_LT(held, 72 * 1024) << "a save left a copy of the state in dosd";
    a.Finish();  // detaches
  }
  EXPECT_TRUE(WaitFor([&] { return ProcStatus(d->pid(), "VmRSS") - before < 24 * 1024; }, 10000))
      << "dosd still holds " << ProcStatus(d->pid(), "VmRSS") - before
      << " kB more than before the session\n"
      << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(Resources, SessionCapsAnswerResourceExhaustedNamingTheFlag) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions_per_uid=3", "--max_sessions=5"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"), d->socket(), {"rpc_attach:n=4", "wait"});
  const std::string line = a.Await("rpc_attach");
  EXPECT_EQ(Code(line), kResourceExhausted) << line;
  EXPECT_EQ(Field(line, "attached"), "3") << line;
  EXPECT_NE(line.find("--max_sessions_per_uid=3"), std::string::npos) << line;
  UserProcess e(User("dos-sec-e"), d->socket(), {"rpc_attach:n=3", "wait"});
  const std::string line_e = e.Await("rpc_attach");
  EXPECT_EQ(Code(line_e), kResourceExhausted) << line_e;
  EXPECT_EQ(Field(line_e, "attached"), "2") << line_e;
  EXPECT_NE(line_e.find("--max_sessions=5"), std::string::npos) << line_e;
  a.Finish();
  e.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// A registration refused for host memory names the orphaned sessions holding
// it: the caller's own by session, pid and lease; another user's only as a
// count and a total (their pids and sessions are theirs).
TEST(Resources, AMemoryRefusalNamesOnlyTheCallersOwnOrphans) {
  DOS_SECURITY_REQUIRE();
  // sec_client's f32 tensor of 65536 parameters holds 768 KiB of state.
  auto d = SecureDaemon({"--host_memory_limit=1M", "--session_lease=5m"});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::vector<std::string> job = {"attach", "register:numel=65536"};
  std::vector<std::string> held = job;
  held.push_back("wait");
  UserProcess dead(User("dos-sec-a"), d->socket(), held);
  ASSERT_EQ(Code(dead.Await("register")), 0) << dead.output() << d->log();
  const pid_t dead_pid = dead.pid();
  dead.Kill();
  ASSERT_TRUE(
      WaitFor([&] { return d->log().find("event=session.orphaned") != std::string::npos; }, 10000))
      << d->log();
  const std::string pid_text = absl::StrCat("(pid ", dead_pid, ", 768.00 KiB, lease ends in ");

  const std::string other = RunAs(User("dos-sec-e"), d->socket(), job);
  const std::string refused = other.substr(other.find("ERR register"));
  EXPECT_EQ(Code(refused), kResourceExhausted) << other;
  EXPECT_NE(refused.find("--host_memory_limit"), std::string::npos) << refused;
  EXPECT_NE(refused.find("1 exited trainer(s) of other users hold 768.00 KiB"), std::string::npos)
      << refused;
  EXPECT_EQ(refused.find(absl::StrCat("pid ", dead_pid)), std::string::npos) << refused;
  EXPECT_EQ(refused.find("trainers of yours"), std::string::npos) << refused;

  const std::string own = RunAs(User("dos-sec-a"), d->socket(), job);
  const std::string own_refused = own.substr(own.find("ERR register"));
  EXPECT_EQ(Code(own_refused), kResourceExhausted) << own;
  EXPECT_NE(own_refused.find(pid_text), std::string::npos) << own_refused;
  EXPECT_NE(own_refused.find("resume="), std::string::npos) << own_refused;
  EXPECT_EQ(own_refused.find("other users"), std::string::npos) << own_refused;
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// One uid's sessions cannot take the whole of --host_memory_limit when
// --max_state_bytes_per_uid bounds each uid: a second registration of one
// user past it is refused naming the flag, and another user still
// registers.
TEST(Resources, StateBytesPerUidLeaveRoomForAnotherUser) {
  DOS_SECURITY_REQUIRE();
  // sec_client's f32 tensor of 65536 parameters holds 768 KiB of state.
  auto d = SecureDaemon({"--host_memory_limit=4M", "--max_state_bytes_per_uid=1M"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess first(User("dos-sec-a"), d->socket(), {"attach", "register:numel=65536", "wait"});
  ASSERT_EQ(Code(first.Await("register")), 0) << first.output() << d->log();
  const std::string second =
      RunAs(User("dos-sec-a"), d->socket(), {"attach", "register:numel=65536"});
  const std::string refused = second.substr(second.find("ERR register"));
  EXPECT_EQ(Code(refused), kResourceExhausted) << second;
  EXPECT_NE(refused.find("--max_state_bytes_per_uid"), std::string::npos) << refused;
  EXPECT_NE(refused.find("holds 768.00 KiB of state_bytes"), std::string::npos) << refused;
  const std::string other =
      RunAs(User("dos-sec-e"), d->socket(), {"attach", "register:numel=65536"});
  EXPECT_EQ(other.find("ERR register"), std::string::npos) << other;
  first.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Issue 11 item 9 as it was found: 2000 attaches that never register cost
// dosd no thread each, and the reaper still closes them all once their
// process is gone.
TEST(Resources, IdleAttachesCostNoThreads) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions=0", "--max_sessions_per_uid=0"});
  ASSERT_TRUE(d->Start()) << d->log();
  const long before = ProcStatus(d->pid(), "Threads");
  UserProcess a(User("dos-sec-a"), d->socket(), {"rpc_attach:n=2000", "wait"});
  const std::string line = a.Await("rpc_attach", 120000);
  ASSERT_EQ(Code(line), 0) << line << d->log().substr(0, 4000);
  const long threads = ProcStatus(d->pid(), "Threads");
  EXPECT_LT(threads - before, 20) << threads << " threads for 2000 idle sessions";
  a.Finish();
  // The reaper still notices that their process is gone.
  EXPECT_TRUE(WaitFor([&] { return Listed(*d) == 0; }, 30000))
      << Listed(*d) << " of 2000 sessions left";
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Issue 11 item 9 as it was found: SIGTERM with 2000 registered sessions
// (each a step thread, a control block and two segments in dosd) finishes
// within 10 s, every session stopped. Both processes need about 5
// descriptors per session: the soft limit is raised to the hard one, and the
// test skips naming it when that is too low.
TEST(Resources, SigtermWithThousandsOfSessionsStopsWithinTenSeconds) {
  DOS_SECURITY_REQUIRE();
  constexpr int kSessions = 2000;
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < 8 * kSessions + 1024) {
    GTEST_SKIP() << "RLIMIT_NOFILE hard limit " << saved.rlim_max << " is below the "
                 << 8 * kSessions + 1024 << " descriptors " << kSessions
                 << " sessions need; raise it (ulimit -Hn) to run this test";
  }
  rlimit raised = saved;
  raised.rlim_cur = saved.rlim_max == RLIM_INFINITY ? 1 << 20 : saved.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
  auto d = SecureDaemon({"--max_sessions=0", "--max_sessions_per_uid=0"});
  const bool started = d->Start();
  UserProcess a(User("dos-sec-a"), d->socket(),
                {"many:n=" + std::to_string(kSessions) + ",numel=16", "wait"});
  ::setrlimit(RLIMIT_NOFILE, &saved);  // both children have inherited the raised one
  ASSERT_TRUE(started) << d->log();
  const std::string line = a.Await("many", 300000);
  ASSERT_EQ(Code(line), 0) << line << d->log().substr(0, 4000);
  ASSERT_EQ(Field(line, "sessions"), std::to_string(kSessions)) << line;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 10.0) << "SIGTERM with " << kSessions << " sessions took " << secs << " s";
  std::printf("SIGTERM with %d registered sessions: %.2f s\n", kSessions, secs);
  // Each closed (its line, or counted among those left out of the log).
  const std::string log = d->log();
  EXPECT_EQ(Count(log, "reason=shutdown") + Suppressed(log, "session.close"),
            static_cast<size_t>(kSessions));
}

// 2000 attaches at once from two users (no caps), then both vanish without
// detaching: a third user's trainer keeps stepping meanwhile, dosctl status
// answers, and the reaper closes every session of the two.
TEST(Resources, AttachFloodsFromSeveralUsersLeaveAnotherUserStepping) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions=0", "--max_sessions_per_uid=0"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess b(User("dos-sec-b"), d->socket(),
                {"attach", "register:numel=4096", "wait", "step:n=50", "wait", "step:n=5"});
  ASSERT_EQ(Code(b.Await("register")), 0) << b.output() << d->log();
  ASSERT_EQ(Code(b.Await("wait")), 0);
  UserProcess a(User("dos-sec-a"), d->socket(), {"rpc_attach:n=1000", "wait"});
  UserProcess e(User("dos-sec-e"), d->socket(), {"rpc_attach:n=1000", "wait"});
  const auto start = std::chrono::steady_clock::now();
  b.Continue();
  const std::string steps = b.Await("step", 60000);
  EXPECT_EQ(Code(steps), 0) << steps << b.output();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 30.0) << "50 steps took " << secs << " s during the attach flood";
  const std::string dosctl = ReachableBinary(DOS_DOSCTL_PATH);
  const std::string status =
      RunCommandAs(User("dos-sec-b"), {dosctl, "--socket=" + d->socket(), "status"});
  EXPECT_NE(status.find("SERVING"), std::string::npos) << status;
  EXPECT_EQ(status.find("NOT_SERVING"), std::string::npos) << status;
  ASSERT_EQ(Code(a.Await("rpc_attach", 120000)), 0) << a.output() << d->log().substr(0, 4000);
  ASSERT_EQ(Code(e.Await("rpc_attach", 120000)), 0) << e.output();
  // Both vanish without detaching.
  a.Kill();
  e.Kill();
  EXPECT_TRUE(WaitFor([&] { return Listed(*d) == 1; }, 60000))
      << Listed(*d) - 1 << " of 2000 sessions left";
  ASSERT_EQ(Code(b.Await("wait")), 0);
  b.Continue();
  EXPECT_EQ(Code(b.Await("step", 30000)), 0) << b.output();
  b.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

TEST(Resources, RepeatedFailuresAreLoggedAFewTimesWithACount) {
  DOS_SECURITY_REQUIRE();
  // A client that keeps making a refused call: an Attach without the ticket
  // that --allow_uids requires, 300 times (dosd warns on each refusal).
  auto d = SecureDaemon({"--allow_uids=" + std::to_string(User("dos-sec-a").uid)});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out =
      RunAs(User("dos-sec-e"), d->socket(), {"rpc_attach:n=300,keep=1"});
  EXPECT_EQ(Field(out, "failed"), "300") << out;
  const std::string log = d->log();
  EXPECT_LE(Count(log, " event=auth.attach_refused"), 10u) << log.size() << " bytes of log";
  EXPECT_EQ(Count(log, "event=log.rate_limited limited_event=auth.attach_refused"), 1u) << log;
  // Other events are limited apart: the trainer that may attach still logs.
  const std::string a = RunAs(User("dos-sec-a"), d->socket(), {"attach", "register:numel=256"});
  EXPECT_NE(a.find("OK register"), std::string::npos) << a << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(Resources, MetricsScrapeIsNotHeldUpByIdleConnections) {
  DOS_SECURITY_REQUIRE();
  const int port = FreeLoopbackPort();
  auto d = SecureDaemon({"--metrics_port=" + std::to_string(port)});
  ASSERT_TRUE(d->Start()) << d->log();
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(ConnectLoopback(port));
  const auto start = std::chrono::steady_clock::now();
  int fd = ConnectLoopback(port);
  ASSERT_GE(fd, 0);
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
  ASSERT_EQ(::write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
  std::string page;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) page.append(buf, static_cast<size_t>(n));
  ::close(fd);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(page.find("dos_sessions 0"), std::string::npos) << page;
  EXPECT_LT(secs, 1.5) << "scrape took " << secs << " s behind 8 idle connections";
  for (int c : idle) ::close(c);
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(Resources, ImportStateRefusesAStepCounterThatWouldOverflow) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                {"attach", "register:numel=1024",
                                 "state_write:step=9223372036854775807", "step",
                                 "state_write:step=-1", "state_write:step=41", "step"});
  const size_t first = out.find("state_write");
  ASSERT_NE(first, std::string::npos) << out;
  EXPECT_NE(out.find("ERR state_write code=3"), std::string::npos) << out;
  EXPECT_EQ(Count(out, "ERR state_write code=3"), 2u) << out;
  EXPECT_NE(out.find("is out of range"), std::string::npos) << out;
  EXPECT_NE(out.find("OK step step=1"), std::string::npos) << out;
  EXPECT_NE(out.find("OK step step=42"), std::string::npos) << out;
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(Resources, CleanStopLeavesNoSocketOrLockFile) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  EXPECT_TRUE(std::filesystem::exists(d->socket() + ".lock"));
  EXPECT_EQ(d->Stop(), 0) << d->log();
  EXPECT_FALSE(std::filesystem::exists(d->socket()));
  EXPECT_FALSE(std::filesystem::exists(d->socket() + ".lock"));
  // And the next daemon on the same socket starts as usual.
}

}  // namespace
}  // namespace dos::testing
