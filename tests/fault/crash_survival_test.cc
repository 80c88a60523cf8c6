// Fault injection through the real dosd: a trainer SIGKILLed mid-step and
// resumed with its session token, dosd SIGKILLed and restarted from its
// checkpoint directory, corrupt and escaping checkpoint paths. Each test
// compares against an uninterrupted run of the same deterministic trainer
// (tests/fault/crash_trainer.cc), bit for bit.
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "dos/wire/control_block.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_process.h"

namespace dos::testing {
namespace {

constexpr int kSteps = 12;

// Runs `args` to completion; exit code, or 128 + signal.
int RunProcess(std::vector<std::string> args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int Trainer(const DaemonProcess& d, const std::string& out, int kill_at,
            const std::string& resume = "") {
  std::vector<std::string> args = {DOS_CRASH_TRAINER_PATH, d.socket(), out,
                                   std::to_string(kSteps), std::to_string(kill_at)};
  if (!resume.empty()) {
    std::istringstream in(resume);
    std::string id, token;
    in >> id >> token;
    args.push_back(id);
    args.push_back(token);
  }
  return RunProcess(args);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<v1::Dos::Stub> Stub(const DaemonProcess& d) {
  return v1::Dos::NewStub(
      grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
}

// The reference: the same trainer, never interrupted.
std::string Reference(const DaemonProcess& d) {
  const std::string out = d.dir() + "/reference.bin";
  EXPECT_EQ(Trainer(d, out, 0), 0) << d.log();
  std::string ref = ReadFile(out);
  EXPECT_GT(ref.size(), 1000u);
  return ref;
}

TEST(CrashSurvivalTest, TrainerKilledMidStepResumesWithExactlyTheUninterruptedResults) {
  DaemonProcess d({"--session_lease=60s"});
  ASSERT_TRUE(d.Start());
  const std::string ref = Reference(d);
  for (int kill_at : {1, 5, kSteps}) {
    SCOPED_TRACE(kill_at);
    const std::string out = d.dir() + "/resumed" + std::to_string(kill_at) + ".bin";
    ASSERT_EQ(Trainer(d, out, kill_at), 128 + SIGKILL);
    const std::string session = ReadFile(out + ".session");
    ASSERT_FALSE(session.empty());
    ASSERT_EQ(Trainer(d, out, 0, session), 0) << d.log();
    EXPECT_TRUE(ReadFile(out) == ref) << "resumed run differs from the uninterrupted one";
  }
  EXPECT_NE(d.log().find("session.resume"), std::string::npos);
  EXPECT_EQ(d.Stop(), 0);
}

TEST(CrashSurvivalTest, ResumeRefusesWrongTokenUnknownIdAndExpiredLease) {
  DaemonProcess d({"--session_lease=2s"});
  ASSERT_TRUE(d.Start());
  const std::string out = d.dir() + "/killed.bin";
  ASSERT_EQ(Trainer(d, out, 3), 128 + SIGKILL);
  std::istringstream in(ReadFile(out + ".session"));
  uint64_t id = 0;
  std::string token;
  in >> id >> token;
  auto stub = Stub(d);
  auto attach = [&](uint64_t sid, const std::string& tok) {
    v1::AttachRequest req;
    req.set_client_name("intruder");
    req.set_pid(::getpid());
    req.set_protocol_version(kProtocolVersion);
    req.set_fd_ticket(FdTicket(d.socket()));
    req.mutable_resume()->set_session_id(sid);
    req.mutable_resume()->set_token(tok);
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    return stub->Attach(&ctx, req, &resp).error_code();
  };
  // dosctl sessions shows it as orphaned once the daemon noticed the death.
  bool orphaned = false;
  for (int i = 0; i < 200 && !orphaned; ++i) {
    v1::ListSessionsResponse list;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok());
    for (const auto& x : list.sessions()) orphaned |= x.session_id() == id && x.state() == "orphaned";
    if (!orphaned) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling
  }
  EXPECT_TRUE(orphaned);
  EXPECT_EQ(attach(id, std::string(token.size(), '0')), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(attach(id + 1000, token), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(attach(id, ""), grpc::StatusCode::INVALID_ARGUMENT);
  // The lease (2 s) runs out: the state is freed and a resume is NOT_FOUND.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline &&
         d.log().find("lease_expired") == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a condition
  }
  EXPECT_EQ(Trainer(d, out, 0, std::to_string(id) + " " + token), 2);
  EXPECT_EQ(d.Stop(), 0);
}

TEST(CrashSurvivalTest, DaemonKilledRestoresFromCheckpointAndTrainerContinuesExactly) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  std::string ref;
  uint64_t saved_id = 0;
  {
    DaemonProcess d({"--checkpoint_dir=" + ckpt, "--session_lease=60s"});
    ASSERT_TRUE(d.Start());
    ref = Reference(d);
    const std::string out = d.dir() + "/killed.bin";
    ASSERT_EQ(Trainer(d, out, 7), 128 + SIGKILL);
    // Operator checkpoint of every session (the orphaned one included).
    auto stub = Stub(d);
    v1::SaveCheckpointRequest req;
    v1::SaveCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = stub->SaveCheckpoint(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message() << d.log();
    ASSERT_EQ(resp.files_size(), 1);
    EXPECT_GE(resp.files(0).step(), 6);
    saved_id = resp.files(0).session_id();
    EXPECT_GT(resp.files(0).bytes(), 104568u * 12);
    std::printf("checkpoint: %llu bytes, step %lld, snapshot (step stall) %.0f us, write %.1f ms\n",
                static_cast<unsigned long long>(resp.files(0).bytes()),
                static_cast<long long>(resp.files(0).step()), resp.files(0).snapshot_us(),
                resp.files(0).write_ms());
    // A corrupt copy that sorts first among the candidates: the restart must
    // refuse it (a CRC fails) and fall back to the intact file.
    std::string bytes = ReadFile(resp.files(0).path());
    bytes[bytes.size() / 2] ^= 0x40;
    // Beside it, in this user's folder of the store (<dir>/uid-<uid>/).
    std::ofstream(ckpt + "/uid-" + std::to_string(::getuid()) + "/zz-corrupt.dckpt",
                  std::ios::binary)
        << bytes;
    d.Kill();  // SIGKILL: no drain, no final checkpoint
  }
  DaemonProcess d({"--checkpoint_dir=" + ckpt});
  ASSERT_TRUE(d.Start());
  const std::string out = d.dir() + "/restored.bin";
  ASSERT_EQ(Trainer(d, out, 0), 0) << d.log();
  EXPECT_NE(d.log().find("session.restored"), std::string::npos) << d.log();
  EXPECT_NE(d.log().find("session.restore_skipped"), std::string::npos) << d.log();
  // Ids go on from the store's files: the restored session does not take the
  // saved one's id (whose autosaves it would prune as its own).
  EXPECT_NE(d.log().find("last_session_id=" + std::to_string(saved_id)), std::string::npos)
      << d.log();
  EXPECT_NE(d.log().find("session.restored session=" + std::to_string(saved_id + 1)),
            std::string::npos)
      << d.log();
  EXPECT_TRUE(ReadFile(out) == ref) << "restored run differs from the uninterrupted one";
  EXPECT_EQ(d.Stop(), 0);
}

TEST(CrashSurvivalTest, CheckpointPathsAreCheckedAndACorruptFileIsRefused) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt, "--session_lease=60s"});
  ASSERT_TRUE(d.Start());
  const std::string out = d.dir() + "/killed.bin";
  ASSERT_EQ(Trainer(d, out, 4), 128 + SIGKILL);
  std::istringstream in(ReadFile(out + ".session"));
  uint64_t id = 0;
  in >> id;
  auto stub = Stub(d);
  auto save = [&](uint64_t sid, const std::string& path, v1::SaveCheckpointResponse* resp) {
    v1::SaveCheckpointRequest req;
    req.set_session_id(sid);
    req.set_path(path);
    grpc::ClientContext ctx;
    return stub->SaveCheckpoint(&ctx, req, resp);
  };
  v1::SaveCheckpointResponse resp;
  EXPECT_EQ(save(id, "../escape.dckpt", &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(save(id, "/etc/escape.dckpt", &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(save(id + 99, "x.dckpt", &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::Status ok = save(id, "good.dckpt", &resp);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(resp.files(0).path(), ckpt + "/uid-" + std::to_string(::getuid()) + "/good.dckpt");
  v1::LoadCheckpointRequest lreq;
  lreq.mutable_session()->set_session_id(id + 99);
  lreq.set_path("good.dckpt");
  v1::LoadCheckpointResponse lresp;
  grpc::ClientContext lctx;
  EXPECT_EQ(stub->LoadCheckpoint(&lctx, lreq, &lresp).error_code(), grpc::StatusCode::NOT_FOUND);
  lreq.mutable_session()->set_session_id(id);
  lreq.set_path("../../etc/passwd");
  grpc::ClientContext lctx2;
  EXPECT_EQ(stub->LoadCheckpoint(&lctx2, lreq, &lresp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(d.Stop(), 0);
}

}  // namespace
}  // namespace dos::testing
