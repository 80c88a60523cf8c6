// Memory isolation (issue 11, items 1, 2, 3, 8, 10 and the /dev/shm
// leftovers of 11): dosd as its own user, trainers and attackers as the
// fixture's users running mem_client. Memory travels only as sealed memfds
// over the descriptor socket; each test failed on the name-based design
// (segments and control blocks in /dev/shm, identity from a claimed pid).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/security/security_env.h"

namespace dos::testing {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kPermissionDenied = 7;

std::vector<std::string> MemArgv(const std::string& socket, std::vector<std::string> ops) {
  return ClientArgv(DOS_MEM_CLIENT_PATH, socket, std::move(ops));
}

std::string RunMem(const SecUser& u, const std::string& socket, std::vector<std::string> ops) {
  UserProcess p(u, MemArgv(socket, std::move(ops)));
  return p.Finish(60000);
}

// The first "OK <op>" / "ERR <op>" line of `out` ("" if none).
std::string Line(const std::string& out, const std::string& op) {
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    for (const char* p : {"OK ", "ERR "}) {
      const std::string head = p + op;
      if (line.rfind(head, 0) == 0 && (line.size() == head.size() || line[head.size()] == ' ')) {
        return line;
      }
    }
  }
  return "";
}

// absl code of a line: 0 for OK, -1 when missing.
int AbslCode(const std::string& line) {
  if (line.rfind("OK ", 0) == 0) return 0;
  const std::string c = Field(line, "code");
  return c.empty() ? -1 : std::atoi(c.c_str());
}

// /dev/shm entries named like this test's objects would have been
// ("dos*" naming one of `pids`, e.g. dosd's control blocks
// "dos.<dosd pid>.<session>.ctl" or a trainer's "dos.<pid>.<session>.<n>").
// Other processes' entries are not counted: tests of other builds may run
// beside this one.
std::set<std::string> DevShmOf(const std::vector<pid_t>& pids) {
  std::set<std::string> out;
  DIR* d = opendir("/dev/shm");
  while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
    const std::string n = e->d_name;
    if (n.rfind("dos", 0) != 0) continue;
    for (pid_t p : pids) {
      const std::string dotted = absl::StrCat(".", p, ".");
      if (n.find(dotted) != std::string::npos || n.find(absl::StrCat("it", p, ".")) != std::string::npos) {
        out.insert(n);
      }
    }
  }
  if (d != nullptr) closedir(d);
  return out;
}

int Sessions(const std::string& socket, v1::ListSessionsResponse* resp) {
  auto stub = v1::Dos::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->ListSessions(&ctx, v1::ListSessionsRequest(), resp).ok() ? resp->sessions_size()
                                                                         : -1;
}

// Item 1: a trainer truncates its own segments (and the control block) to 0
// and steps and reads state: the seals refuse every truncation, dosd lives.
TEST(MemoryIsolation, TrainerCannotShrinkItsMemoryUnderDosd) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out = RunMem(User("dos-sec-a"), d->socket(),
                                 {"attach", "register:numel=65536", "truncate_own", "step:n=2",
                                  "state_read"});
  const std::string t = Line(out, "truncate_own");
  ASSERT_EQ(AbslCode(t), 0) << out;
  EXPECT_GE(std::atoi(Field(t, "total").c_str()), 2) << out;  // param and grad buffers
  EXPECT_EQ(Field(t, "eperm"), Field(t, "total")) << out;
  EXPECT_EQ(Field(Line(out, "step"), "step"), "2") << out << d->log();
  EXPECT_EQ(Field(Line(out, "state_read"), "step"), "2") << out;
  EXPECT_EQ(::kill(d->pid(), 0), 0) << "dosd died: " << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 1, during ExportState: the trainer shrinks the buffer it handed dosd
// for an export (the seal refuses), the export completes, dosd lives.
TEST(MemoryIsolation, TrainerCannotShrinkAnExportBufferUnderDosd) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out = RunMem(User("dos-sec-a"), d->socket(),
                                 {"attach", "register:numel=65536", "step:n=1",
                                  "export_truncate", "step:n=1"});
  const std::string e = Line(out, "export_truncate");
  ASSERT_EQ(AbslCode(e), 0) << out << d->log();
  EXPECT_EQ(Field(e, "eperm"), "1") << out;
  EXPECT_EQ(Field(e, "step"), "1") << out;
  EXPECT_EQ(Field(Line(out, "step"), "step"), "1") << out;
  EXPECT_NE(out.find("OK step step=2"), std::string::npos) << out << d->log();
  EXPECT_EQ(::kill(d->pid(), 0), 0) << "dosd died: " << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// dosd refuses descriptors that are not sealed memfds, saying why.
TEST(MemoryIsolation, UnsealedMemfdsAndFilesAreRefused) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out =
      RunMem(User("dos-sec-a"), d->socket(), {"attach", "send_unsealed", "send_file"});
  const std::string u = Line(out, "send_unsealed");
  EXPECT_EQ(AbslCode(u), kFailedPrecondition) << out;
  EXPECT_NE(u.find("F_SEAL_SHRINK"), std::string::npos) << out;
  EXPECT_EQ(AbslCode(Line(out, "send_file")), kInvalidArgument) << out;
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 2: another user of the group finds nothing in /dev/shm and cannot
// fetch the control block or pass memory into the session, even with the
// session's id and token.
TEST(MemoryIsolation, NoOtherUserReachesASessionsMemory) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess victim(User("dos-sec-a"), MemArgv(d->socket(), {"attach", "register", "wait"}));
  ASSERT_FALSE(victim.Await("wait").empty()) << victim.output() << d->log();
  const std::string a = Line(victim.output(), "attach");
  const std::string id = Field(a, "id"), token = Field(a, "token");
  ASSERT_FALSE(id.empty()) << victim.output();
  EXPECT_TRUE(DevShmOf({d->pid(), victim.pid(), std::atoi(Field(a, "pid").c_str())}).empty());
  const std::string creds = absl::StrCat("id=", id, ",token=", token);
  const std::string out = RunMem(User("dos-sec-b"), d->socket(),
                                 {"control:" + creds, "inject:" + creds});
  EXPECT_EQ(AbslCode(Line(out, "control")), kPermissionDenied) << out;
  EXPECT_EQ(AbslCode(Line(out, "inject")), kPermissionDenied) << out;
  // The owner itself with a wrong token gets nothing either.
  const std::string own = RunMem(User("dos-sec-a"), d->socket(),
                                 {absl::StrCat("control:id=", id, ",token=0000")});
  EXPECT_EQ(AbslCode(Line(own, "control")), kPermissionDenied) << own;
  victim.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 3: a shm name in RegisterShard or ExportState is refused; an object
// only dosd's user may write stays untouched.
TEST(MemoryIsolation, MemoryByNameIsRefused) {
  DOS_SECURITY_REQUIRE();
  const std::string name = absl::StrCat("dos-sec-secret.", getpid());
  const std::string path = "/dev/shm/" + name;
  {
    std::ofstream f(path);
    f << std::string(4096 * 4, 's');
  }
  const SecUser du = User("dos-sec-d");
  ASSERT_EQ(::chown(path.c_str(), du.uid, du.gid), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out =
      RunMem(User("dos-sec-a"), d->socket(),
             {"attach", "register_name:name=/" + name, "register", "export_name:name=/" + name});
  EXPECT_EQ(AbslCode(Line(out, "register_name")), kInvalidArgument) << out;
  EXPECT_EQ(AbslCode(Line(out, "register")), 0) << out;
  EXPECT_EQ(AbslCode(Line(out, "export_name")), kInvalidArgument) << out;
  std::ifstream f(path);
  std::string content((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, std::string(4096 * 4, 's'));
  ::unlink(path.c_str());
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 8: /dev/shm files that another local user created ahead under the
// names control blocks used to get do not affect Attach.
TEST(MemoryIsolation, SquattedDevShmNamesDoNotAffectAttach) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  std::vector<std::string> squatted;
  std::vector<std::string> touch = {"/usr/bin/touch"};
  for (int n = 1; n <= 8; ++n) {
    for (const std::string& prefix : {std::string("dos."), absl::StrCat("dos-it", getpid(), ".")}) {
      squatted.push_back(absl::StrCat("/dev/shm/", prefix, d->pid(), ".", n, ".ctl"));
      touch.push_back(squatted.back());
    }
  }
  RunCommandAs(User("dos-sec-c"), touch);
  const std::string out =
      RunMem(User("dos-sec-a"), d->socket(), {"attach", "register", "step:n=2"});
  EXPECT_EQ(Field(Line(out, "step"), "step"), "2") << out << d->log();
  for (const std::string& p : squatted) ::unlink(p.c_str());
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 10: a trainer in the group by supplementary membership only trains.
TEST(MemoryIsolation, SupplementaryGroupMemberTrains) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out =
      RunMem(User("dos-sec-b"), d->socket(), {"attach", "register", "step:n=2", "state_read"});
  EXPECT_EQ(Field(Line(out, "step"), "step"), "2") << out << d->log();
  EXPECT_EQ(AbslCode(Line(out, "state_read")), 0) << out;
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// Item 10: a trainer in its own pid namespace (it believes it is pid 1)
// attaches under the allow lists, steps, and is reaped when it dies: its
// identity is the kernel's (SO_PEERCRED, pidfd), not the pid it claims.
TEST(MemoryIsolation, TrainerInAPidNamespaceAttachesAndIsReaped) {
  DOS_SECURITY_REQUIRE();
  if (::access("/usr/bin/unshare", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/unshare";
  auto d = SecureDaemon({"--session_lease=0", "--allow_uids=0"});
  ASSERT_TRUE(d->Start()) << d->log();
  SecUser root;
  root.name = "root";
  std::vector<std::string> argv = {"/usr/bin/unshare", "--pid", "--fork", "--kill-child",
                                   "--mount-proc"};
  for (const std::string& a :
       MemArgv(d->socket(), {"attach", "register", "step:n=3", "wait"})) {
    argv.push_back(a);
  }
  UserProcess trainer(root, argv);
  ASSERT_FALSE(trainer.Await("wait", 60000).empty()) << trainer.output() << d->log();
  EXPECT_EQ(Field(Line(trainer.output(), "attach"), "pid"), "1") << trainer.output();
  EXPECT_EQ(Field(Line(trainer.output(), "step"), "step"), "3") << trainer.output() << d->log();
  v1::ListSessionsResponse list;
  ASSERT_EQ(Sessions(d->socket(), &list), 1) << d->log();
  EXPECT_GT(list.sessions(0).pid(), 1) << "dosd took the claimed pid";
  trainer.Kill();
  EXPECT_TRUE(WaitFor(
      [&] {
        v1::ListSessionsResponse l;
        return Sessions(d->socket(), &l) == 0;
      },
      10000))
      << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

// The leftovers of 11: a dosd killed with sessions attached, and a failed
// register, leave nothing in /dev/shm.
TEST(MemoryIsolation, KilledDosdAndFailedRegisterLeaveNothingInDevShm) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--session_memory_limit=1M"});
  ASSERT_TRUE(d->Start()) << d->log();
  // Its segments reach dosd, then the limit refuses the registration.
  const std::string failed =
      RunMem(User("dos-sec-a"), d->socket(), {"attach", "register:numel=1000000"});
  EXPECT_NE(AbslCode(Line(failed, "register")), 0) << failed;
  UserProcess t(User("dos-sec-a"), MemArgv(d->socket(), {"attach", "register", "wait"}));
  ASSERT_FALSE(t.Await("wait").empty()) << t.output() << d->log();
  const pid_t dosd = d->pid();
  d->Kill();
  t.Finish();
  EXPECT_TRUE(DevShmOf({dosd, getpid()}).empty());
}

}  // namespace
}  // namespace dos::testing
