// Operator features of the real dosd: the Prometheus endpoint, the
// per-session memory quota, dosctl's checkpoint and stats --watch commands,
// and the errors a new operator meets (a refused registration, checkpoints
// off or unwritable, a socket folder that refuses the user), each naming the
// real cause and the fix.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_fixture.h"
#include "tests/support/loopback.h"

namespace dos::testing {
namespace {

std::string Shell(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

// Step arguments for one group, `h`.
dos_step_args OneGroup(dos_hparams* h) {
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = h;
  a.num_groups = 1;
  return a;
}

struct Trainer {
  dos_session* s = nullptr;
  dos_hparams h;
  dos_status Start(const std::string& socket, uint64_t n, const char* name = "ops_test") {
    if (dos_status st = AttachClient(socket, name, &s); st != DOS_OK) return st;
    void* p = nullptr;
    void* g = nullptr;
    if (dos_status st = dos_buffer_alloc(s, n * 4, &p); st != DOS_OK) return st;
    if (dos_status st = dos_buffer_alloc(s, n * 4, &g); st != DOS_OK) return st;
    dos_tensor t{"w", DOS_DTYPE_F32, p, DOS_DTYPE_F32, g, n, 0};
    dos_hparams_init_adamw(&h);
    return dos_register(s, &t, 1, &h, 1, nullptr);
  }
  dos_status Step() {
    const dos_step_args a = OneGroup(&h);
    dos_step_result r;
    return dos_step(s, &a, &r);
  }
  ~Trainer() { dos_detach(s); }
};

TEST(OpsTest, MetricsEndpointCountsSteps) {
  const int port = FreeLoopbackPort();
  DaemonProcess d({"--metrics_port=" + std::to_string(port)});
  ASSERT_TRUE(d.Start());
  {
    Trainer t;
    ASSERT_EQ(t.Start(d.socket(), 1000), DOS_OK) << dos_last_error();
    for (int i = 0; i < 3; ++i) ASSERT_EQ(t.Step(), DOS_OK) << dos_last_error();
    const std::string page = HttpGet(port, "/metrics");
    EXPECT_NE(page.find("dos_steps_total 3"), std::string::npos) << page;
    EXPECT_NE(page.find("dos_params_updated_total{device=\"cpu\"} 3000"), std::string::npos)
        << page;
    EXPECT_NE(page.find("dos_sessions 1"), std::string::npos) << page;
    // 1000 parameters: 12000 bytes of state in one page-aligned subgroup.
    EXPECT_NE(page.find("dos_host_state_bytes 12288"), std::string::npos) << page;
  }
  EXPECT_EQ(d.Stop(), 0);
}

TEST(OpsTest, SessionMemoryLimitRefusesAnOversizedRegistration) {
  DaemonProcess d({"--session_memory_limit=1M"});
  ASSERT_TRUE(d.Start());
  {
    Trainer small;
    EXPECT_EQ(small.Start(d.socket(), 1000), DOS_OK) << dos_last_error();
    Trainer big;
    EXPECT_EQ(big.Start(d.socket(), 1 << 20), DOS_RESOURCE_EXHAUSTED);
    const std::string error = dos_last_error();
    EXPECT_NE(error.find("--session_memory_limit"), std::string::npos) << error;
    // Said once: "register: the tensors hold ...", not "register: register: ...".
    EXPECT_EQ(error.rfind("register: ", 0), 0u) << error;
    EXPECT_EQ(error.find("register: register:"), std::string::npos) << error;
    // And the operator sees the refusal in dosd's log.
    const std::string log = d.log();
    const size_t at = log.find("event=session.register_refused");
    ASSERT_NE(at, std::string::npos) << log;
    const std::string line = log.substr(at, log.find('\n', at) - at);
    EXPECT_NE(line.find("client=ops_test"), std::string::npos) << line;
    EXPECT_NE(line.find("RESOURCE_EXHAUSTED"), std::string::npos) << line;
    EXPECT_NE(line.find("--session_memory_limit"), std::string::npos) << line;
  }
  EXPECT_EQ(d.Stop(), 0);
}

// Checkpoints off (no --checkpoint_dir, or a folder dosd cannot make) is
// FAILED_PRECONDITION with the reason and the fix, not UNAVAILABLE (which
// dosctl took for a daemon that does not answer).
TEST(OpsTest, CheckpointsOffAreAFailedPreconditionThatSaysWhy) {
  const TempDir tmp("dos-ckpt-off");
  const std::string file = tmp.path() + "/a-file";
  std::fclose(std::fopen(file.c_str(), "w"));
  for (const auto& [flag, why] :
       {std::pair<std::string, std::string>{"--checkpoint_dir=",
                                            "dosd runs with --checkpoint_dir empty; restart it"},
        {"--checkpoint_dir=" + file + "/sub", "--checkpoint_dir=" + file + "/sub is not a "
                                              "directory and cannot be created"}}) {
    DaemonProcess d({flag});
    ASSERT_TRUE(d.Start()) << d.log();
    grpc::ClientContext ctx;
    v1::SaveCheckpointResponse resp;
    const grpc::Status st = DosStub(d.socket())->SaveCheckpoint(&ctx, {}, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    const std::string out = Shell(std::string(DOS_DOSCTL_PATH) + " --socket=" + d.socket() +
                                  " checkpoint save all 2>&1; echo rc=$?");
    EXPECT_NE(out.find("checkpoints are off in this dosd: " + why), std::string::npos) << out;
    EXPECT_EQ(out.find("does not answer"), std::string::npos) << out;
    EXPECT_NE(out.find("rc=1"), std::string::npos) << out;
    EXPECT_EQ(d.Stop(), 0);
  }
}

// A checkpoint folder dosd may not write is named with the fix at startup,
// not a surprise at the first save. The store must be dosd's alone (issue
// 24): one it owns it makes 0700 and uses; one another uid owns stops dosd
// (exit 1) with the path, the owner and the chown that fixes it.
TEST(OpsTest, UnwritableCheckpointFolderIsNamedWithTheFixAtStartup) {
  const TempDir ckpt("dos-ckpt-ro");
  DaemonProcess d({"--checkpoint_dir=" + ckpt.path()});
  if (::geteuid() == 0) {
    // Root writes anywhere: run dosd as nobody, the folder stays root's.
    ASSERT_EQ(::chmod(ckpt.path().c_str(), 0755), 0);
    d.RunAs(65534, 65534, 0007);
    EXPECT_FALSE(d.Start()) << d.log();
    const std::string log = d.log();
    const size_t at = log.find("event=daemon.checkpoint_dir");
    ASSERT_NE(at, std::string::npos) << log;
    const std::string line = log.substr(at, log.find('\n', at) - at);
    EXPECT_NE(line.find(ckpt.path() + " is owned by uid 0"), std::string::npos) << line;
    EXPECT_NE(line.find("chown 65534 " + ckpt.path()), std::string::npos) << line;
  } else {
    ASSERT_EQ(::chmod(ckpt.path().c_str(), 0555), 0);
    ASSERT_TRUE(d.Start()) << d.log();
    EXPECT_EQ(d.log().find("event=checkpoint.dir_not_writable"), std::string::npos) << d.log();
    struct stat st;
    ASSERT_EQ(::stat(ckpt.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(d.Stop(), 0);
  }
  ::chmod(ckpt.path().c_str(), 0755);  // for TempDir's cleanup
}

// The packaged layout: /run/dos is 0750 for group dos. A user outside the
// group (or added to it after logging in) is told so, not that no dosd runs.
TEST(OpsTest, DosctlNamesTheGroupWhenTheSocketFolderRefusesTheUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run dosctl as a user outside the group";
  if (Shell("command -v setpriv").empty()) GTEST_SKIP() << "no setpriv (util-linux)";
  DaemonProcess d;
  ASSERT_TRUE(d.Start()) << d.log();
  ASSERT_EQ(::chmod(d.dir().c_str(), 0750), 0);  // root's group only
  const std::string out =
      Shell("setpriv --reuid=65534 --regid=65534 --clear-groups " + std::string(DOS_DOSCTL_PATH) +
            " --socket=" + d.socket() + " status 2>&1; echo rc=$?");
  EXPECT_NE(out.find("the folder " + d.dir() + " (mode 0750, group root) does not let"),
            std::string::npos) << out;
  EXPECT_NE(out.find("usermod -aG root"), std::string::npos) << out;
  EXPECT_NE(out.find("log in again"), std::string::npos) << out;
  EXPECT_EQ(out.find("no dosd socket"), std::string::npos) << out;
  EXPECT_NE(out.find("rc=1"), std::string::npos) << out;
  EXPECT_EQ(d.Stop(), 0);
}

TEST(OpsTest, DosctlCheckpointSaveLoadAndStatsWatch) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt});
  ASSERT_TRUE(d.Start());
  {
    Trainer t;
    ASSERT_EQ(t.Start(d.socket(), 1000), DOS_OK) << dos_last_error();
    ASSERT_EQ(t.Step(), DOS_OK);
    const std::string dosctl = std::string(DOS_DOSCTL_PATH) + " --socket=" + d.socket() + " ";
    const std::string id = std::to_string(dos_session_id(t.s));
    std::string out = Shell(dosctl + "checkpoint save " + id + " mine.dckpt 2>&1");
    // Paths are relative to the session owner's folder, <dir>/uid-<uid>.
    EXPECT_NE(out.find(ckpt + "/uid-" + std::to_string(::getuid()) + "/mine.dckpt"),
              std::string::npos)
        << out;
    ASSERT_EQ(t.Step(), DOS_OK);
    out = Shell(dosctl + "checkpoint load " + id + " mine.dckpt 2>&1");
    EXPECT_NE(out.find("mine.dckpt"), std::string::npos) << out;
    int64_t step = 0;
    ASSERT_EQ(dos_state_read(t.s, 0, nullptr, nullptr, nullptr, &step), DOS_OK);
    EXPECT_EQ(step, 1);  // back to the saved step
    out = Shell(dosctl + "checkpoint save all 2>&1");
    EXPECT_NE(out.find("ops_test.r-1"), std::string::npos) << out;
    out = Shell(dosctl + "checkpoint save " + id + " ../../etc/x 2>&1");
    EXPECT_NE(out.find("outside the checkpoint folder"), std::string::npos) << out;
    out = Shell(dosctl + "--watch --interval=10ms --count=2 stats 2>&1");
    EXPECT_EQ(std::count(out.begin(), out.end(), '-') >= 6, true) << out;
    EXPECT_NE(out.find("CKPT STALL MAX US"), std::string::npos) << out;
  }
  EXPECT_EQ(d.Stop(), 0);
}

TEST(OpsTest, GroupIsGivenToTheSocketAndControlBlocks) {
  // As root any gid works; otherwise our own (chown to a group we are in).
  const gid_t gid = ::getuid() == 0 ? 4242 : ::getgid();
  DaemonProcess d({"--group=" + std::to_string(gid)});
  ASSERT_TRUE(d.Start());
  struct stat st;
  // dosd accepts connections a moment before it chmods/chowns the socket.
  for (int i = 0; i < 500; ++i) {
    ASSERT_EQ(::stat(d.socket().c_str(), &st), 0);
    if (st.st_gid == gid && (st.st_mode & 0777) == 0660) break;
    usleep(10'000);  // polling a condition, 5 s deadline
  }
  EXPECT_EQ(st.st_gid, gid);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  {
    // The descriptor socket (control blocks and segments travel there, as
    // memfds: nothing in /dev/shm has a mode or group to get wrong).
    const std::string fd_socket = d.socket() + ".fd";
    ASSERT_EQ(::stat(fd_socket.c_str(), &st), 0) << fd_socket;
    EXPECT_EQ(st.st_gid, gid);
    EXPECT_EQ(st.st_mode & 0777, 0660u);
    Trainer t;
    ASSERT_EQ(t.Start(d.socket(), 10), DOS_OK) << dos_last_error();
  }
  EXPECT_EQ(d.Stop(), 0);
}

TEST(OpsTest, AutosaveWritesEachNewStepAndKeepsTheNewest) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt, "--autosave_interval=50ms", "--autosave_keep=2"});
  ASSERT_TRUE(d.Start());
  const std::string dir = ckpt + "/uid-" + std::to_string(::getuid()) + "/ops_test.r-1/";
  auto exists = [](const std::string& p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0;
  };
  {
    Trainer t;
    ASSERT_EQ(t.Start(d.socket(), 1000), DOS_OK) << dos_last_error();
    // Named for the session too: another job of the same name and rank
    // neither overwrites nor prunes them.
    const std::string sfx = ".s" + std::to_string(dos_session_id(t.s)) + ".dckpt";
    const std::string other = dir + "auto-000000000000.s999" + ".dckpt";
    for (int step = 1; step <= 3; ++step) {
      ASSERT_EQ(t.Step(), DOS_OK);
      const std::string f = dir + "auto-00000000000" + std::to_string(step) + sfx;
      for (int i = 0; i < 500 && !exists(f); ++i) usleep(10'000);  // polling, 5 s deadline
      EXPECT_TRUE(exists(f)) << f << d.log();
      if (step == 1) std::ofstream(other) << "another job's";
    }
    for (int i = 0; i < 500 && exists(dir + "auto-000000000001" + sfx); ++i) usleep(10'000);
    EXPECT_FALSE(exists(dir + "auto-000000000001" + sfx)) << "not pruned";
    EXPECT_TRUE(exists(dir + "auto-000000000002" + sfx));
    EXPECT_TRUE(exists(other)) << "another session's autosave was pruned";
  }
  EXPECT_EQ(d.Stop(), 0);
  EXPECT_NE(d.log().find("daemon.final_checkpoint"), std::string::npos);
}

// Two trainers on `d`, "ops_stalled" and "ops_busy"; the stalled one steps
// once, then begins an early step (`a`) that gets no verdict: from then on
// its session waits for its trainer.
void StartStalledAndBusy(DaemonProcess& d, Trainer& stalled, Trainer& busy, dos_step_args* a) {
  ASSERT_EQ(stalled.Start(d.socket(), 1000, "ops_stalled"), DOS_OK) << dos_last_error();
  ASSERT_EQ(busy.Start(d.socket(), 1000, "ops_busy"), DOS_OK) << dos_last_error();
  ASSERT_EQ(stalled.Step(), DOS_OK);
  dos_step_args_init(a);
  a->groups = &stalled.h;
  a->num_groups = 1;
  ASSERT_EQ(dos_step_begin_early(stalled.s, a, 0, nullptr), DOS_OK) << dos_last_error();
}

// A trainer whose early step never gets its verdict holds its session (dosd
// waits up to --early_step_ready_timeout): autosaves save the other
// sessions first and skip it, so another user's autosaves go on; a clean
// stop ends that step (nothing applied) and saves both sessions instead of
// waiting for it (DaemonProcess::Stop gives up after 20 s).
TEST(OpsTest, AStalledEarlyStepHoldsUpNeitherOtherAutosavesNorTheStop) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt, "--autosave_interval=50ms"});
  ASSERT_TRUE(d.Start());
  const std::string dir = ckpt + "/uid-" + std::to_string(::getuid()) + "/ops_busy.r-1/";
  auto exists = [](const std::string& p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0;
  };
  Trainer stalled, busy;
  dos_step_args a;
  ASSERT_NO_FATAL_FAILURE(StartStalledAndBusy(d, stalled, busy, &a));
  // No verdict: the stalled session's step waits for it from now on.
  for (int step = 1; step <= 3; ++step) {
    ASSERT_EQ(busy.Step(), DOS_OK);
    const std::string f = dir + "auto-00000000000" + std::to_string(step) + ".s" +
                          std::to_string(dos_session_id(busy.s)) + ".dckpt";
    for (int i = 0; i < 1000 && !exists(f); ++i) usleep(10'000);  // polling, 10 s deadline
    EXPECT_TRUE(exists(f)) << f << d.log();
  }
  EXPECT_NE(d.log().find("checkpoint.autosave_skipped"), std::string::npos) << d.log();
  EXPECT_EQ(d.Stop(), 0) << d.log();
  EXPECT_NE(d.log().find("event=daemon.final_checkpoint ok=1 files=2"), std::string::npos)
      << d.log();
}

// True once dosd counts an early step of this uid waiting for its trainer
// (GetStats' per-uid usage), within 10 s; then a short grace for the step
// thread to go from the count to its wait.
bool WaitForEarlyStep(v1::Dos::Stub& stub) {
  for (int i = 0; i < 1000; ++i) {
    v1::GetStatsResponse stats;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (stub.GetStats(&ctx, v1::GetStatsRequest(), &stats).ok()) {
      for (const auto& u : stats.uids()) {
        if (u.uid() == ::getuid() && u.early_steps() > 0) {
          usleep(100'000);
          return true;
        }
      }
    }
    usleep(10'000);
  }
  return false;
}

// SaveCheckpoint of `session` (0: every session) with a 60 s deadline; the
// call's duration in `*seconds`.
grpc::Status TimedSave(v1::Dos::Stub& stub, uint64_t session, double* seconds) {
  v1::SaveCheckpointRequest req;
  req.set_session_id(session);
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const auto t0 = std::chrono::steady_clock::now();
  grpc::Status st = stub.SaveCheckpoint(&ctx, req, &resp);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// A dosd with checkpoints, a stalled and a busy trainer on it
// (StartStalledAndBusy).
struct StalledNode {
  TempDir ckpt_dir{"dos-ckpt"};
  DaemonProcess d{{"--checkpoint_dir=" + ckpt_dir.path()}};
  Trainer stalled, busy;
  dos_step_args a;
};

// Starts `n`: the busy trainer stepped once, and dosd holding the stalled
// one's early step.
void StartWithAStalledStep(StalledNode& n) {
  ASSERT_TRUE(n.d.Start());
  ASSERT_NO_FATAL_FAILURE(StartStalledAndBusy(n.d, n.stalled, n.busy, &n.a));
  ASSERT_EQ(n.busy.Step(), DOS_OK);
  // dos_step_begin_early returns once the request is sent: wait until dosd
  // holds the early step (the uid's count of early steps waiting for their
  // trainer), else the save could run before the step and find nothing stalled.
  ASSERT_TRUE(WaitForEarlyStep(*DosStub(n.d.socket()))) << n.d.log();
}

// As for autosaves (above), an explicit save of every session (`dosctl checkpoint save`
// without --session): the other sessions are saved at once, and the call
// fails within seconds naming the stalled session and what to do, instead of
// waiting for it up to --early_step_ready_timeout.
TEST(OpsTest, AnExplicitSaveOfEverySessionSavesTheOthersAndNamesTheStalledOne) {
  StalledNode n;
  ASSERT_NO_FATAL_FAILURE(StartWithAStalledStep(n));
  auto stub = DosStub(n.d.socket());
  double s = 0;
  grpc::Status st = TimedSave(*stub, 0, &s);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_LT(s, 30.0) << "waited for the stalled trainer";
  const std::string msg = st.error_message();
  EXPECT_NE(msg.find("saved 1 session(s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ops_busy"), std::string::npos) << msg;  // the file saved
  EXPECT_NE(msg.find("session " + std::to_string(dos_session_id(n.stalled.s))), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("--session"), std::string::npos) << msg;
  // The stalled step, once its verdict comes, completes as usual.
  ASSERT_EQ(dos_step_verdict(n.stalled.s, &n.a, nullptr), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_step_wait(n.stalled.s, 30000, nullptr), DOS_OK) << dos_last_error();
  EXPECT_EQ(n.d.Stop(), 0) << n.d.log();
}

// An explicit save of the stalled session alone (`dosctl checkpoint save
// --session N`) waits a few seconds for its step, not up to
// --early_step_ready_timeout: one user's stalled trainer cannot hold the
// node's checkpointer (one save at a time for every user). The busy
// session's save right after it goes through; once the verdict comes, the
// stalled session saves too.
TEST(OpsTest, AnExplicitSaveOfAStalledSessionFailsWithinSecondsAndFreesTheCheckpointer) {
  StalledNode n;
  ASSERT_NO_FATAL_FAILURE(StartWithAStalledStep(n));
  auto stub = DosStub(n.d.socket());
  double s = 0;
  grpc::Status st = TimedSave(*stub, dos_session_id(n.stalled.s), &s);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_LT(s, 30.0) << "waited for the stalled trainer";
  EXPECT_NE(st.error_message().find("session " + std::to_string(dos_session_id(n.stalled.s))),
            std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("reaches step()"), std::string::npos) << st.error_message();
  st = TimedSave(*stub, dos_session_id(n.busy.s), &s);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_LT(s, 30.0);
  ASSERT_EQ(dos_step_verdict(n.stalled.s, &n.a, nullptr), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_step_wait(n.stalled.s, 30000, nullptr), DOS_OK) << dos_last_error();
  st = TimedSave(*stub, dos_session_id(n.stalled.s), &s);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(n.d.Stop(), 0) << n.d.log();
}

TEST(OpsTest, TcpListenerServesLoopbackAndRefusesRemoteUnlessAllowed) {
  const int port = FreeLoopbackPort();
  DaemonProcess d({"--tcp_listen=127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(d.Start());
  auto stub = v1::Dos::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                   grpc::InsecureChannelCredentials()));
  v1::GetStatsResponse stats;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status st = stub->GetStats(&ctx, v1::GetStatsRequest(), &stats);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(stats.uptime_s(), 0);
  // The session list (job names, pids) is not for TCP callers (no identity).
  v1::ListSessionsResponse list;
  grpc::ClientContext ctx2;
  st = stub->ListSessions(&ctx2, v1::ListSessionsRequest(), &list);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_NE(st.error_message().find("--tcp_operator_calls"), std::string::npos);
  EXPECT_EQ(d.Stop(), 0);

  DaemonProcess remote({"--tcp_listen=0.0.0.0:" + std::to_string(FreeLoopbackPort())});
  EXPECT_FALSE(remote.Start());
  EXPECT_NE(remote.log().find("--tcp_allow_remote"), std::string::npos) << remote.log();
}

TEST(OpsTest, PeerCredentialsAreCheckedAgainstTheAllowList) {
  {
    DaemonProcess d({"--allow_uids=" + std::to_string(::getuid() + 4242)});
    ASSERT_TRUE(d.Start());
    Trainer t;
    EXPECT_EQ(t.Start(d.socket(), 10), DOS_PERMISSION_DENIED);
    EXPECT_NE(std::string(dos_last_error()).find("--allow_uids"), std::string::npos)
        << dos_last_error();
    EXPECT_EQ(d.Stop(), 0);
  }
  DaemonProcess d({"--allow_uids=" + std::to_string(::getuid()), "--allow_gids=4242"});
  ASSERT_TRUE(d.Start());
  {
    Trainer t;
    EXPECT_EQ(t.Start(d.socket(), 10), DOS_OK) << dos_last_error();
  }
  auto stub = DosStub(d.socket());
  auto attach = [&](const std::string& ticket, int pid) {
    v1::AttachRequest req;
    req.set_pid(pid);
    req.set_protocol_version(kProtocolVersion);
    req.set_fd_ticket(ticket);
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    return stub->Attach(&ctx, req, &resp).error_code();
  };
  EXPECT_EQ(attach("", ::getpid()), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(attach("forged", ::getpid()), grpc::StatusCode::PERMISSION_DENIED);
  // The descriptor socket's ticket is bound to the process the kernel
  // reported there and used once; the pid a request claims changes nothing.
  const std::string ticket = FdTicket(d.socket());
  ASSERT_FALSE(ticket.empty());
  EXPECT_EQ(attach(ticket, 1), grpc::StatusCode::OK);
  EXPECT_EQ(attach(ticket, ::getpid()), grpc::StatusCode::PERMISSION_DENIED);
  // One ticket socket: the descriptor socket's (an older dosd also served
  // <socket>.auth).
  EXPECT_NE(::access((d.socket() + ".auth").c_str(), F_OK), 0);
  EXPECT_EQ(d.Stop(), 0);
}

// A delayed trainer whose parameter and gradient it keeps (CPU mode).
struct DelayedTrainer {
  dos_session* s = nullptr;
  dos_hparams h;
  float* param = nullptr;
  float* grad = nullptr;
  uint64_t n = 0;
  dos_status Start(const std::string& socket, uint64_t numel, const char* name) {
    n = numel;
    if (dos_status st = AttachClient(socket, name, &s); st != DOS_OK) return st;
    void* p = nullptr;
    void* g = nullptr;
    if (dos_status st = dos_buffer_alloc(s, n * 4, &p); st != DOS_OK) return st;
    if (dos_status st = dos_buffer_alloc(s, n * 4, &g); st != DOS_OK) return st;
    param = static_cast<float*>(p);
    grad = static_cast<float*>(g);
    for (uint64_t i = 0; i < n; ++i) param[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
    dos_tensor t{"w", DOS_DTYPE_F32, p, DOS_DTYPE_F32, g, n, 0};
    dos_hparams_init_adamw(&h);
    if (dos_status st = dos_register(s, &t, 1, &h, 1, nullptr); st != DOS_OK) return st;
    return dos_set_step_delay(s, 1);
  }
  ~DelayedTrainer() { dos_detach(s); }
};

// torch's in-place clip beside a delayed step's captures (protocols 9, 10):
// an early delayed step stops dosd's captures (dos_step_stop_captures waits
// only for a copy dosd had begun), scales its gradients in place by c and
// says so (dos_step_gradients_scaled). dosd updates its copies times c, or
// copies them after the verdict when the stop came first: either way the
// state and weights are bit for bit those of a trainer that steps on the
// scaled gradients. The calls are refused out of order.
TEST(OpsTest, GradientsScaledAfterTheCapturesStopAreTheScaledGradientsStep) {
  DaemonProcess d({"--log_level=debug"});
  ASSERT_TRUE(d.Start());
  {
    DelayedTrainer scaled, plain;
    ASSERT_EQ(scaled.Start(d.socket(), 5000, "ops_scaled"), DOS_OK) << dos_last_error();
    ASSERT_EQ(plain.Start(d.socket(), 5000, "ops_plain"), DOS_OK) << dos_last_error();
    const dos_step_args a = OneGroup(&scaled.h), b = OneGroup(&plain.h);
    EXPECT_EQ(dos_step_gradients_scaled(scaled.s, 0.5f), DOS_FAILED_PRECONDITION);
    EXPECT_EQ(dos_step_stop_captures(scaled.s, nullptr, 1000), DOS_FAILED_PRECONDITION);
    const float c = 0.3719f;
    for (int step = 1; step <= 4; ++step) {
      for (uint64_t i = 0; i < scaled.n; ++i) {
        const float g = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(step));
        scaled.grad[i] = g;
        plain.grad[i] = g * c;
      }
      ASSERT_EQ(dos_step_begin_early(scaled.s, &a, 0, nullptr), DOS_OK) << dos_last_error();
      if (step % 2 == 0) {
        // Before backward marks anything ready, while dosd may still update
        // the last step: nothing was begun, so nothing is waited for (no
        // time allowed), and dosd copies nothing before the verdict.
        ASSERT_EQ(dos_step_stop_captures(scaled.s, nullptr, 0), DOS_OK) << dos_last_error();
        ASSERT_EQ(dos_mark_ready(scaled.s, 0, 0, nullptr), DOS_OK) << dos_last_error();
      } else {
        ASSERT_EQ(dos_mark_ready(scaled.s, 0, 0, nullptr), DOS_OK) << dos_last_error();
        EXPECT_EQ(dos_step_gradients_scaled(scaled.s, c), DOS_FAILED_PRECONDITION);
        ASSERT_EQ(dos_step_stop_captures(scaled.s, nullptr, 10000), DOS_OK) << dos_last_error();
      }
      EXPECT_EQ(dos_step_gradients_scaled(scaled.s, -1.0f), DOS_INVALID_ARGUMENT);
      for (uint64_t i = 0; i < scaled.n; ++i) scaled.grad[i] *= c;
      ASSERT_EQ(dos_step_gradients_scaled(scaled.s, c), DOS_OK) << dos_last_error();
      ASSERT_EQ(dos_step_verdict(scaled.s, &a, nullptr), DOS_OK) << dos_last_error();
      dos_step_result r;
      ASSERT_EQ(dos_step_wait(scaled.s, 10000, &r), DOS_OK) << dos_last_error();
      ASSERT_EQ(dos_step(plain.s, &b, &r), DOS_OK) << dos_last_error();
    }
    ASSERT_EQ(dos_step_finish_delayed(scaled.s, nullptr, 10000), DOS_OK) << dos_last_error();
    ASSERT_EQ(dos_step_finish_delayed(plain.s, nullptr, 10000), DOS_OK) << dos_last_error();
    std::vector<float> m1(scaled.n), v1(scaled.n), m2(scaled.n), v2(scaled.n), w1(scaled.n),
        w2(scaled.n);
    ASSERT_EQ(dos_state_read(scaled.s, 0, w1.data(), m1.data(), v1.data(), nullptr), DOS_OK);
    ASSERT_EQ(dos_state_read(plain.s, 0, w2.data(), m2.data(), v2.data(), nullptr), DOS_OK);
    EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), m1.size() * 4));
    EXPECT_EQ(0, std::memcmp(v1.data(), v2.data(), v1.size() * 4));
    EXPECT_EQ(0, std::memcmp(w1.data(), w2.data(), w1.size() * 4));
    EXPECT_EQ(0, std::memcmp(scaled.param, plain.param, scaled.n * 4));
  }
  EXPECT_EQ(d.Stop(), 0);
  // The copies were kept and scaled, not copied again.
  EXPECT_NE(d.log().find("rewritten=0 scaled_by=0.3719"), std::string::npos) << d.log();
}

// A save of every session (dosctl checkpoint save all, the final save at
// SIGTERM) goes on past one that fails: here a folder one user made where
// dosd's default name for her next save goes ("squatting" on it). The other
// session is saved; the error names the failed one and why.
TEST(OpsTest, ASaveOfEverySessionGoesOnPastOneThatFails) {
  const TempDir ckpt_dir("dos-ckpt");
  DaemonProcess d({"--checkpoint_dir=" + ckpt_dir.path()});
  ASSERT_TRUE(d.Start());
  {
    Trainer squatter, other;
    ASSERT_EQ(squatter.Start(d.socket(), 1000, "ops_squatter"), DOS_OK) << dos_last_error();
    ASSERT_EQ(other.Start(d.socket(), 1000, "ops_other"), DOS_OK) << dos_last_error();
    ASSERT_EQ(squatter.Step(), DOS_OK);
    ASSERT_EQ(other.Step(), DOS_OK);
    const std::string id = std::to_string(dos_session_id(squatter.s));
    const std::string dosctl = std::string(DOS_DOSCTL_PATH) + " --socket=" + d.socket() + " ";
    // Step 2's default file name made a folder (a save into a file below it).
    std::string out = Shell(dosctl + "checkpoint save " + id + " ops_squatter.r-1/" +
                            "step-000000000002.s" + id + ".dckpt/x.dckpt 2>&1");
    ASSERT_NE(out.find("x.dckpt"), std::string::npos) << out;
    ASSERT_EQ(squatter.Step(), DOS_OK);
    out = Shell(dosctl + "checkpoint save all 2>&1; echo rc=$?");
    EXPECT_NE(out.find("saved 1 session(s)"), std::string::npos) << out;
    EXPECT_NE(out.find("ops_other.r-1/step-000000000001.s"), std::string::npos) << out;
    EXPECT_NE(out.find("failed: session " + id), std::string::npos) << out;
    EXPECT_NE(out.find("rc=1"), std::string::npos) << out;
  }
  EXPECT_EQ(d.Stop(), 0) << d.log();
}

// One uid's checkpoint calls take at most kCheckpointCallsPerUid (8) places
// at once: dosd has one checkpoint writer for every user, so a flood of one
// user's saves is refused at once (RESOURCE_EXHAUSTED naming the uid) instead
// of queueing ahead of everyone else's, each holding a dosd thread. Here
// eight saves wait for a stalled session; a ninth call is refused; all eight
// end once the trainer gives its verdict.
TEST(OpsTest, OneUidHoldsAtMostEightCheckpointCallsAtOnce) {
  StalledNode n;
  ASSERT_NO_FATAL_FAILURE(StartWithAStalledStep(n));
  const uint64_t stalled = dos_session_id(n.stalled.s);
  std::vector<std::thread> waiting;
  std::atomic<int> refused{0};
  for (int i = 0; i < 8; ++i) {
    waiting.emplace_back([&] {
      double s = 0;
      grpc::Status st = TimedSave(*DosStub(n.d.socket()), stalled, &s);
      if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
    });
  }
  // The eight hold their places for at least the first one's 5 s wait for
  // the stalled trainer. A delete of nothing then is refused; one that gets
  // in before the last save arrived (NOT_FOUND) takes a place for a moment,
  // which could turn that save away: polled only after a head start.
  usleep(1'500'000);
  auto stub = DosStub(n.d.socket());
  grpc::Status st;
  int probes_in = 0;
  for (int i = 0; i < 200; ++i) {
    v1::DeleteCheckpointRequest req;
    req.set_path("nothing-here.dckpt");
    v1::DeleteCheckpointResponse resp;
    grpc::ClientContext ctx;
    st = stub->DeleteCheckpoint(&ctx, req, &resp);
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    ++probes_in;
    usleep(10'000);  // polling, 2 s deadline
  }
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("uid " + std::to_string(::getuid()) + " already has 8"),
            std::string::npos)
      << st.error_message();
  ASSERT_EQ(dos_step_verdict(n.stalled.s, &n.a, nullptr), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_step_wait(n.stalled.s, 30000, nullptr), DOS_OK) << dos_last_error();
  for (std::thread& t : waiting) t.join();
  if (probes_in == 0) {
    EXPECT_EQ(refused.load(), 0);  // no probe took a save's place
  }
  // The places are given back: a save now goes through.
  double s = 0;
  st = TimedSave(*stub, stalled, &s);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(n.d.Stop(), 0) << n.d.log();
}

}  // namespace
}  // namespace dos::testing
