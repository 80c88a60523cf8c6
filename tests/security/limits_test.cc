// Issue 24, items 7 and 8: file descriptors (the soft limit raised at start, a
// reserve that keeps a new user's attach working while another user holds as
// many sessions as dosd's descriptors allow), info lines rate-limited per
// event and uid, ListSessions kept from TCP callers, control characters in
// checkpoint paths and an empty descriptor-socket message refused naming the
// input, and idle connections that cannot hold up a metrics scrape.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/security/security_env.h"
#include "tests/support/loopback.h"

namespace dos::testing {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kPermissionDenied = 7;

// Lines of `log` that have every one of `parts`.
size_t LinesWith(const std::string& log, const std::vector<std::string>& parts) {
  size_t n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    bool all = true;
    for (const std::string& p : parts) all = all && line.find(p) != std::string::npos;
    n += all ? 1 : 0;
  }
  return n;
}

// Lines of `event` (and `uid`) left out of the log: the suppressed=N of its
// next line and of the log.suppressed line dosd writes at exit.
size_t Suppressed(const std::string& log, const std::string& event, const std::string& uid) {
  size_t n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("event=log.rate_limited") != std::string::npos) continue;  // says "=N"
    if (line.find("event=" + event + uid) == std::string::npos &&
        (line.find("event=" + event + " ") == std::string::npos ||
         line.find(uid) == std::string::npos)) {
      continue;
    }
    const std::string v = Field(line, "suppressed");
    n += v.empty() ? 0 : std::stoul(v);
  }
  return n;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// dosd as the unit runs it, started through `sh -c "ulimit ...; exec dosd"`
// (the test cannot lower its own hard limit and raise it back without
// CAP_SYS_RESOURCE).
std::unique_ptr<DaemonProcess> DaemonWithFileLimit(int soft, int hard,
                                                   std::vector<std::string> flags) {
  static const std::string script = [] {
    char tmpl[] = "/tmp/dos-sec-ulimit-XXXXXX";
    const std::string dir = ::mkdtemp(tmpl);
    ::chmod(dir.c_str(), 0755);
    return dir + "/dosd-ulimit.sh";
  }();
  const char* env = std::getenv("DOS_DOSD");
  const std::string dosd = ReachableBinary(env != nullptr && env[0] != '\0' ? env : DOS_DOSD_PATH);
  {
    std::ofstream out(script);
    out << "#!/bin/sh\nulimit -Sn " << soft << " && ulimit -Hn " << hard << " && exec " << dosd
        << " \"$@\"\n";
  }
  ::chmod(script.c_str(), 0755);
  flags.insert(flags.begin(), {"--group=dos-sec", "--socket_mode=0660"});
  auto d = std::make_unique<DaemonProcess>(std::move(flags));
  const SecUser du = User("dos-sec-d");
  d->RunAs(du.uid, du.gid, 0007, script);
  return d;
}

// dosd started with RLIMIT_NOFILE 256 (hard 512) and 96 kept in reserve: one
// user attaches sessions until dosd refuses it more; another user's attach,
// registration and steps still work, and dosd says why.
TEST(Limits, ADescriptorReserveKeepsANewUsersAttachWorking) {
  DOS_SECURITY_REQUIRE();
  auto d = DaemonWithFileLimit(256, 512, {"--max_sessions_per_uid=0", "--fd_reserve=96"});
  ASSERT_TRUE(d->Start()) << d->log();
  // The soft limit is raised to the hard one.
  EXPECT_EQ(LinesWith(d->log(), {"event=daemon.file_limit", "soft_before=256", "soft=512"}), 1u)
      << d->log();
  UserProcess attacker(User("dos-sec-a"), d->socket(), {"many:n=400,numel=16", "wait"});
  const std::string many = attacker.Await("many", 120000);
  EXPECT_NE(many.find("ERR many"), std::string::npos) << many;
  EXPECT_NE(many.find("short of file descriptors"), std::string::npos) << many << d->log();
  const auto start = std::chrono::steady_clock::now();
  const std::string victim = RunAs(User("dos-sec-e"), d->socket(),
                                   {"attach", "register:numel=4096", "step:n=5"});
  EXPECT_NE(victim.find("OK attach"), std::string::npos) << victim << d->log();
  EXPECT_NE(victim.find("OK step step=5"), std::string::npos) << victim;
  EXPECT_LT(SecondsSince(start), 10.0);
  EXPECT_NE(d->log().find("event=daemon.fd_reserve_refused uid=" +
                          std::to_string(User("dos-sec-a").uid)),
            std::string::npos) << d->log();
  attacker.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// One user's idle connections to the gRPC socket (a descriptor each in dosd)
// are bounded per uid (twice --max_sessions_per_uid, plus 16): with
// RLIMIT_NOFILE 256, 400 of them leave another user attaching and stepping
// (unbounded, dosd ran out of descriptors and the attach failed).
TEST(Limits, IdleConnectionsOfOneUserAreBoundedPerUid) {
  DOS_SECURITY_REQUIRE();
  auto d = DaemonWithFileLimit(256, 256, {"--max_sessions_per_uid=8"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess attacker(User("dos-sec-a"), d->socket(), {"connect:n=400", "wait"});
  ASSERT_EQ(Code(attacker.Await("connect")), 0) << attacker.output();
  EXPECT_TRUE(WaitFor([&] {
    return d->log().find("event=auth.connection_refused uid=" +
                         std::to_string(User("dos-sec-a").uid)) != std::string::npos;
  }, 10000)) << d->log().substr(0, 4000);
  const std::string victim = RunAs(User("dos-sec-e"), d->socket(),
                                   {"attach", "register:numel=4096", "step:n=3"});
  EXPECT_NE(victim.find("OK step step=3"), std::string::npos) << victim << d->log().substr(0, 4000);
  attacker.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Control blocks of closed sessions that a process still maps (a memfd each,
// in dosd's memory, and one descriptor of dosd's) count as its uid's sessions:
// a user attaching, mapping the block and detaching 40 times in one process
// holds 8 (--max_sessions_per_uid), is told why, and another user still
// attaches; once the process exits, the user attaches again.
TEST(Limits, ClosedControlBlocksStillMappedCountAsSessions) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions_per_uid=8"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess attacker(User("dos-sec-a"), d->socket(), {"hold_blocks:n=40", "wait"});
  const std::string held = attacker.Await("hold_blocks");
  EXPECT_EQ(Field(held, "held"), "8") << held << d->log().substr(0, 4000);
  EXPECT_NE(held.find("8 of them closed, their control blocks still mapped"), std::string::npos)
      << held;
  const std::string victim =
      RunAs(User("dos-sec-e"), d->socket(), {"attach", "register:numel=4096", "step:n=2"});
  EXPECT_NE(victim.find("OK step step=2"), std::string::npos) << victim;
  attacker.Finish();
  EXPECT_TRUE(WaitFor(
      [&] {
        return RunAs(User("dos-sec-a"), d->socket(), {"attach"}).find("OK attach") !=
               std::string::npos;
      },
      5000))
      << d->log().substr(0, 4000);
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// A client name that says "uid=<another user's uid>" is a quoted value, not
// the line's uid: 150 such attaches neither escape the limit nor use up the
// other user's lines.
TEST(Limits, AClientNameCannotClaimAnotherUsersLogLines) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions_per_uid=0"});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string a_uid = " uid=" + std::to_string(User("dos-sec-a").uid);
  const std::string e_uid = " uid=" + std::to_string(User("dos-sec-e").uid);
  const std::string out =
      RunAs(User("dos-sec-a"), d->socket(), {"rpc_attach:name=j" + e_uid + " z,n=150"});
  EXPECT_EQ(Field(out, "attached"), "150") << out << d->log().substr(0, 4000);
  const std::string e = RunAs(User("dos-sec-e"), d->socket(), {"attach"});
  EXPECT_NE(e.find("OK attach"), std::string::npos) << e;
  const std::string log = d->log();
  EXPECT_LE(LinesWith(log, {" event=session.attach ", a_uid}), 40u) << log.size() << " bytes";
  size_t e_lines = 0;  // e's own line: its uid outside the forged name
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, " event=session.attach ") && !absl::StrContains(line, " z\"") &&
        absl::StrContains(line, e_uid)) {
      ++e_lines;
    }
  }
  EXPECT_EQ(e_lines, 1u) << log;
  EXPECT_EQ(d->Stop(), 0);
}

// One user attaching 150 times logs session.attach 20 times and a count; the
// next user's line is not held back.
TEST(Limits, InfoLinesAreRateLimitedPerEventAndUid) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions_per_uid=0"});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string a_uid = " uid=" + std::to_string(User("dos-sec-a").uid);
  const std::string out = RunAs(User("dos-sec-a"), d->socket(), {"rpc_attach:n=150"});
  ASSERT_NE(out.find("OK rpc_attach id="), std::string::npos) << out << d->log();
  EXPECT_EQ(Field(out, "attached"), "150") << out;
  const std::string e = RunAs(User("dos-sec-e"), d->socket(), {"attach"});
  EXPECT_NE(e.find("OK attach"), std::string::npos) << e;
  const std::string log = d->log();
  const size_t logged = LinesWith(log, {" event=session.attach ", a_uid});
  EXPECT_LE(logged, 40u) << log.size() << " bytes";  // 20 per 10 s
  EXPECT_GE(LinesWith(log, {"event=log.rate_limited limited_event=session.attach" + a_uid}), 1u)
      << log;
  EXPECT_EQ(LinesWith(log, {" event=session.attach ",
                            " uid=" + std::to_string(User("dos-sec-e").uid)}),
            1u) << log;
  // Nothing goes uncounted: at exit dosd reports what it left out.
  EXPECT_EQ(d->Stop(), 0);
  EXPECT_EQ(logged + Suppressed(d->log(), "session.attach", a_uid), 150u) << d->log();
}

// Smaller items: ListSessions over TCP, control characters, an empty
// descriptor-socket message, idle connections before a metrics scrape.
TEST(Limits, OutsidersAndOddInputsAreAnsweredClearly) {
  DOS_SECURITY_REQUIRE();
  const int tcp = FreeLoopbackPort();
  const int metrics = FreeLoopbackPort();
  auto d = SecureDaemon({"--tcp_listen=127.0.0.1:" + std::to_string(tcp),
                         "--metrics_port=" + std::to_string(metrics)});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess job(User("dos-sec-b"), d->socket(),
                  {"attach:name=secret-job", "register:numel=256", "rpc_list", "wait"});
  ASSERT_EQ(Code(job.Await("rpc_list")), 0) << job.output() << d->log();
  // An outsider over TCP reads the stats but not the job names and pids.
  const std::string outsider = RunAs(User("dos-sec-c"), "tcp:127.0.0.1:" + std::to_string(tcp),
                                     {"rpc_list", "rpc_stats"});
  EXPECT_EQ(Code(outsider.substr(outsider.find("rpc_list") - 4)), kPermissionDenied) << outsider;
  EXPECT_NE(outsider.find("--tcp_operator_calls"), std::string::npos) << outsider;
  EXPECT_EQ(outsider.find("secret-job"), std::string::npos) << outsider;
  EXPECT_NE(outsider.find("OK rpc_stats sessions=1"), std::string::npos) << outsider;
  // Control characters in checkpoint paths; an empty descriptor message.
  const std::string a = RunAs(User("dos-sec-a"), d->socket(),
                              {"attach", "register:numel=256", "rpc_save:id=self,path=a\nb.dckpt",
                               "rpc_delete:path=x\x1b[2J", "fd_empty"});
  EXPECT_NE(a.find("ERR rpc_save code=3"), std::string::npos) << a;
  EXPECT_NE(a.find("path has control character 0x0a at byte 1"), std::string::npos) << a;
  EXPECT_NE(a.find("ERR rpc_delete code=3"), std::string::npos) << a;
  EXPECT_NE(a.find("control character 0x1b"), std::string::npos) << a;
  EXPECT_EQ(Code(a.substr(a.find("fd_empty") - 4)), kInvalidArgument) << a;
  EXPECT_NE(a.find("the message is empty"), std::string::npos) << a;
  EXPECT_EQ(a.find("peer closed"), std::string::npos) << a;
  // 100 idle connections (the server polls 64 at once), then a scrape.
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(ConnectLoopback(metrics));
  const auto start = std::chrono::steady_clock::now();
  const std::string page = HttpGet(metrics, "/metrics");
  const double secs = SecondsSince(start);
  EXPECT_NE(page.find("dos_sessions 1"), std::string::npos) << page;
  EXPECT_LT(secs, 0.5) << "scrape took " << secs << " s behind 100 idle connections";
  for (int c : idle) ::close(c);
  job.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

}  // namespace
}  // namespace dos::testing
