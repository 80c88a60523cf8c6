// Operator features of the real dosd: the Prometheus endpoint, the
// per-session memory quota, dosctl's checkpoint and stats --watch commands.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <grpcpp/grpcpp.h>
#include <sys/un.h>

#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "gtest/gtest.h"
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
    dos_step_args a;
    dos_step_args_init(&a);
    a.groups = &h;
    a.num_groups = 1;
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
    EXPECT_NE(std::string(dos_last_error()).find("--session_memory_limit"), std::string::npos)
        << dos_last_error();
  }
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
    for (int step = 1; step <= 3; ++step) {
      ASSERT_EQ(t.Step(), DOS_OK);
      const std::string f = dir + "auto-00000000000" + std::to_string(step) + ".dckpt";
      for (int i = 0; i < 500 && !exists(f); ++i) usleep(10'000);  // polling, 5 s deadline
      EXPECT_TRUE(exists(f)) << f << d.log();
    }
    for (int i = 0; i < 500 && exists(dir + "auto-000000000001.dckpt"); ++i) usleep(10'000);
    EXPECT_FALSE(exists(dir + "auto-000000000001.dckpt")) << "not pruned";
    EXPECT_TRUE(exists(dir + "auto-000000000002.dckpt"));
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
    const std::string f = dir + "auto-00000000000" + std::to_string(step) + ".dckpt";
    for (int i = 0; i < 1000 && !exists(f); ++i) usleep(10'000);  // polling, 10 s deadline
    EXPECT_TRUE(exists(f)) << f << d.log();
  }
  EXPECT_NE(d.log().find("checkpoint.autosave_skipped"), std::string::npos) << d.log();
  EXPECT_EQ(d.Stop(), 0) << d.log();
  EXPECT_NE(d.log().find("event=daemon.final_checkpoint ok=1 files=2"), std::string::npos)
      << d.log();
}

// The same for an explicit save of every session (`dosctl checkpoint save`
// without --session): the other sessions are saved at once, and the call
// fails within seconds naming the stalled session and what to do, instead of
// waiting for it up to --early_step_ready_timeout.
TEST(OpsTest, AnExplicitSaveOfEverySessionSavesTheOthersAndNamesTheStalledOne) {
  const TempDir ckpt_dir("dos-ckpt");
  DaemonProcess d({"--checkpoint_dir=" + ckpt_dir.path()});
  ASSERT_TRUE(d.Start());
  Trainer stalled, busy;
  dos_step_args a;
  ASSERT_NO_FATAL_FAILURE(StartStalledAndBusy(d, stalled, busy, &a));
  ASSERT_EQ(busy.Step(), DOS_OK);
  auto stub = DosStub(d.socket());
  v1::SaveCheckpointRequest req;  // session 0: every session
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const auto t0 = std::chrono::steady_clock::now();
  grpc::Status st = stub->SaveCheckpoint(&ctx, req, &resp);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_LT(s, 30.0) << "waited for the stalled trainer";
  const std::string msg = st.error_message();
  EXPECT_NE(msg.find("saved 1 session(s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ops_busy"), std::string::npos) << msg;  // the file saved
  EXPECT_NE(msg.find("session " + std::to_string(dos_session_id(stalled.s))), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("--session"), std::string::npos) << msg;
  // The stalled step, once its verdict comes, completes as usual.
  ASSERT_EQ(dos_step_verdict(stalled.s, &a, nullptr), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_step_wait(stalled.s, 30000, nullptr), DOS_OK) << dos_last_error();
  EXPECT_EQ(d.Stop(), 0) << d.log();
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

}  // namespace
}  // namespace dos::testing
