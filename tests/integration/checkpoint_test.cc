// Checkpoints taken while a trainer steps: the stall they cause (the time a
// step waits for the session lock the snapshot holds) against the step's own
// time, and the file's size and write time. Prints what it measured. And the
// files' contents: each is exactly the state at the step it records.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dos/dos.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_fixture.h"

namespace dos::testing {
namespace {

// Registers `n` bf16 parameters (1.0) with fixed, varied bf16 gradients.
void RegisterProbe(dos_session* s, uint64_t n, uint64_t subgroup, dos_hparams* h) {
  void* param = nullptr;
  void* grad = nullptr;
  ASSERT_EQ(dos_buffer_alloc(s, n * 2, &param), DOS_OK);
  ASSERT_EQ(dos_buffer_alloc(s, n * 2, &grad), DOS_OK);
  for (uint64_t i = 0; i < n; ++i) {
    static_cast<uint16_t*>(param)[i] = 0x3f80;
    static_cast<uint16_t*>(grad)[i] = static_cast<uint16_t>(0x3c00 + (i * 7 & 0x1ff));
  }
  dos_tensor t{"w", DOS_DTYPE_BF16, param, DOS_DTYPE_BF16, grad, n, 0};
  dos_hparams_init_adamw(h);
  dos_register_options ro{subgroup};
  ASSERT_EQ(dos_register(s, &t, 1, h, 1, &ro), DOS_OK) << dos_last_error();
}

// Steps session `s` (one group, hyperparameters `h`) on a thread of its own
// until Stop(), sleeping `gap_us` between steps (a forward and backward).
class StepLoop {
 public:
  StepLoop(dos_session* s, const dos_hparams* h, int gap_us = 0)
      : thread_([this, s, h, gap_us] {
          dos_step_args a;
          dos_step_args_init(&a);
          a.groups = h;
          a.num_groups = 1;
          dos_step_result r;
          while (!stop_.load() && dos_step(s, &a, &r) == DOS_OK) {
            steps_.fetch_add(1);
            if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
          }
        }) {}
  ~StepLoop() { Stop(); }
  int steps() const { return steps_.load(); }
  void WaitForSteps(int n) const {
    while (steps_.load() < n) std::this_thread::yield();
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> steps_{0};
  std::thread thread_;
};

// SaveCheckpoint of `session` (to `path` under the checkpoint folder; "" for
// dosd's own name); the one file it wrote into *file.
void Save(v1::Dos::Stub* stub, uint64_t session, const std::string& path,
          v1::CheckpointFile* file) {
  v1::SaveCheckpointRequest req;
  req.set_session_id(session);
  if (!path.empty()) req.set_path(path);
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  grpc::Status st = stub->SaveCheckpoint(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.files_size(), 1);
  *file = resp.files(0);
}

// The session's statistics (GetStats of one session).
void Stats(v1::Dos::Stub* stub, uint64_t session, v1::SessionStats* out) {
  v1::GetStatsRequest req;
  req.set_session_id(session);
  v1::GetStatsResponse stats;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->GetStats(&ctx, req, &stats).ok());
  ASSERT_EQ(stats.sessions_size(), 1);
  *out = stats.sessions(0);
}

// gap_us: time the trainer spends between steps (its forward and backward);
// the snapshot overlaps it, so the step stall is max(0, copy - gap).
class CheckpointStallTest : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointStallTest, SaveWhileTrainingStallsOnlyForTheSnapshot) {
  const int gap_us = GetParam();
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt});
  ASSERT_TRUE(d.Start());
  dos_session* s = nullptr;
  ASSERT_EQ(AttachClient(d.socket(), "stall_probe", &s), DOS_OK) << dos_last_error();
  const uint64_t n = uint64_t{16} << 20;  // 16 Mi bf16 parameters: 192 MiB of state
  dos_hparams h;
  RegisterProbe(s, n, uint64_t{4} << 20, &h);
  ASSERT_FALSE(HasFatalFailure());

  StepLoop loop(s, &h, gap_us);
  auto stub = DosStub(d.socket());
  std::vector<v1::CheckpointFile> files(3);
  for (int i = 0; i < 3; ++i) {
    loop.WaitForSteps(2 * (i + 1));
    Save(stub.get(), dos_session_id(s), "", &files[i]);
    ASSERT_FALSE(HasFatalFailure());
  }
  const int during = loop.steps();
  loop.Stop();
  v1::SessionStats ss;
  Stats(stub.get(), dos_session_id(s), &ss);
  ASSERT_FALSE(HasFatalFailure());
  for (const auto& f : files) {
    std::printf(
        "checkpoint step=%lld bytes=%llu snapshot_us=%.0f write_ms=%.1f step_wall_us=%.0f "
        "snapshot/step=%.3f\n",
        static_cast<long long>(f.step()), static_cast<unsigned long long>(f.bytes()),
        f.snapshot_us(), f.write_ms(), f.last_step_wall_us(),
        f.snapshot_us() / f.last_step_wall_us());
    EXPECT_EQ(f.bytes() > n * 12, true);
  }
  std::printf("gap_us=%d steps=%d (during saves: %d) step_wall_us=%.0f lock_wait_max_us=%.0f "
              "lock_wait_total_us=%.0f\n",
              gap_us, loop.steps(), during, ss.last_step().wall_us(), ss.lock_wait_us_max(),
              ss.lock_wait_us_total());
  // Training went on during the saves, and no step waited longer than one
  // snapshot (plus scheduling noise), never for a file write.
  double max_snapshot = 0;
  for (const auto& f : files) max_snapshot = std::max(max_snapshot, f.snapshot_us());
  EXPECT_LT(ss.lock_wait_us_max(), max_snapshot + 50'000);
  EXPECT_EQ(dos_detach(s), DOS_OK);
  EXPECT_EQ(d.Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(BackToBackAndWithForwardBackward, CheckpointStallTest,
                         ::testing::Values(0, 30000), [](const auto& info) {
                           return info.param == 0
                                      ? std::string("BackToBack")
                                      : "Gap" + std::to_string(info.param) + "us";
                         });

// dosd's resident memory (anonymous and shared), from /proc.
uint64_t ResidentBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  uint64_t kib = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("RssAnon:", 0) == 0 || line.rfind("RssShmem:", 0) == 0) {
      kib += std::stoull(line.substr(line.find(':') + 1));
    }
  }
  return kib << 10;
}

// A save keeps no copy of the state behind (at 7B fp32 that copy was 81 GB
// beside the state's 81 GB): saves taken while training, with the steps'
// copies allowed, leave dosd's memory where it was.
TEST(CheckpointMemoryTest, SavesLeaveNoCopyOfTheStateBehind) {
  const TempDir ckpt_dir("dos-ckpt");
  DaemonProcess d({"--checkpoint_dir=" + ckpt_dir.path()});
  ASSERT_TRUE(d.Start());
  dos_session* s = nullptr;
  ASSERT_EQ(AttachClient(d.socket(), "memory_probe", &s), DOS_OK) << dos_last_error();
  const uint64_t n = uint64_t{16} << 20;  // 192 MiB of state
  dos_hparams h;
  RegisterProbe(s, n, uint64_t{1} << 20, &h);
  ASSERT_FALSE(HasFatalFailure());
  StepLoop loop(s, &h);
  loop.WaitForSteps(2);
  const uint64_t before = ResidentBytes(d.pid());
  auto stub = DosStub(d.socket());
  for (int i = 0; i < 3; ++i) {
    v1::CheckpointFile f;
    loop.WaitForSteps(loop.steps() + 2);
    Save(stub.get(), dos_session_id(s), "", &f);
    ASSERT_FALSE(HasFatalFailure());
  }
  loop.Stop();
  const uint64_t after = ResidentBytes(d.pid());
  std::printf("dosd resident: %.1f MiB before the saves, %.1f MiB after (state %.1f MiB)\n",
              before / 1048576.0, after / 1048576.0, 12.0 * n / 1048576.0);
  EXPECT_LT(after, before + 12 * n / 4) << "a save left a copy of the state in dosd";
  EXPECT_EQ(dos_detach(s), DOS_OK);
  EXPECT_EQ(d.Stop(), 0);
}

// A file dosd saves must be one its loads and restart can find: folder loads
// and the restart scan look for ".dckpt" only, so another name is refused,
// naming the fix, before anything is written.
TEST(CheckpointPathTest, AFileNameWithoutTheSuffixIsRefusedNamingIt) {
  const TempDir ckpt_dir("dos-ckpt");
  DaemonProcess d({"--checkpoint_dir=" + ckpt_dir.path()});
  ASSERT_TRUE(d.Start());
  dos_session* s = nullptr;
  ASSERT_EQ(AttachClient(d.socket(), "suffix_probe", &s), DOS_OK) << dos_last_error();
  dos_hparams h;
  RegisterProbe(s, 4096, 1024, &h);
  ASSERT_FALSE(HasFatalFailure());
  auto stub = DosStub(d.socket());
  v1::SaveCheckpointRequest req;
  req.set_session_id(dos_session_id(s));
  req.set_path("mine.ckpt");
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status st = stub->SaveCheckpoint(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("'mine.ckpt' does not end in .dckpt"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("save as 'mine.ckpt.dckpt'"), std::string::npos);
  v1::CheckpointFile f;
  Save(stub.get(), dos_session_id(s), "mine.dckpt", &f);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(f.path().ends_with("/mine.dckpt")) << f.path();
  Save(stub.get(), dos_session_id(s), "sub/", &f);  // a folder: dosd names the file
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(f.path().ends_with(".dckpt")) << f.path();
  EXPECT_EQ(dos_detach(s), DOS_OK);
  EXPECT_EQ(d.Stop(), 0);
}

// Checkpoints are copy-on-write: the lock is held only to mark the step
// boundary and steps keep running while the file is written from the state,
// copying a subgroup themselves before they overwrite it, or, past
// --checkpoint_staging_limit, waiting for the writer to pass it. Each file
// must still hold exactly (bitwise) the state at the step count it records:
// a second session replays the same steps and compares its state with each
// file loaded back. The parameter is --checkpoint_staging_limit: the
// default; none (every step that meets an unwritten subgroup waits); two
// subgroups' worth (12 MiB).
class CheckpointCopyOnWriteTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointCopyOnWriteTest, FilesTakenWhileStepsRunBackToBackAreExactStepBoundaries) {
  const TempDir ckpt_dir("dos-ckpt");
  const std::string ckpt = ckpt_dir.path();
  DaemonProcess d({"--checkpoint_dir=" + ckpt, "--checkpoint_staging_limit=" + GetParam()});
  ASSERT_TRUE(d.Start());
  dos_session* s = nullptr;
  ASSERT_EQ(AttachClient(d.socket(), "cow_trainer", &s), DOS_OK) << dos_last_error();
  // 16 subgroups, so steps and the copier meet mid-state.
  const uint64_t n = uint64_t{8} << 20;
  const uint64_t subgroup = uint64_t{512} << 10;
  dos_hparams h;
  RegisterProbe(s, n, subgroup, &h);
  ASSERT_FALSE(HasFatalFailure());

  StepLoop loop(s, &h);
  auto stub = DosStub(d.socket());
  std::vector<v1::CheckpointFile> files(4);
  for (int i = 0; i < 4; ++i) {
    loop.WaitForSteps(3 * (i + 1));
    Save(stub.get(), dos_session_id(s), "cow-" + std::to_string(i) + ".dckpt", &files[i]);
    ASSERT_FALSE(HasFatalFailure());
  }
  loop.Stop();
  v1::SessionStats ss;
  Stats(stub.get(), dos_session_id(s), &ss);
  ASSERT_FALSE(HasFatalFailure());
  uint32_t copied_by_steps = 0;
  for (const auto& f : files) {
    std::printf("checkpoint step=%lld lock_us=%.0f copy_ms=%.1f copied_by_steps=%u/%llu "
                "write_ms=%.1f\n",
                static_cast<long long>(f.step()), f.snapshot_us(), f.copy_ms(),
                f.subgroups_copied_by_steps(), static_cast<unsigned long long>(n / subgroup),
                f.write_ms());
    copied_by_steps += f.subgroups_copied_by_steps();
    if (GetParam() == "0") {
      EXPECT_EQ(f.subgroups_copied_by_steps(), 0u);
    } else if (GetParam() == "12M") {
      EXPECT_LE(f.subgroups_copied_by_steps(), 2u);
    }
  }
  std::printf("steps=%d step_wall_us=%.0f lock_wait_max_us=%.0f snapshot_wait_max_us=%.0f "
              "snapshot_wait_total_us=%.0f\n",
              loop.steps(), ss.last_step().wall_us(), ss.lock_wait_us_max(),
              ss.snapshot_wait_us_max(), ss.snapshot_wait_us_total());
  // The steps' copy-on-write work is reported as their snapshot wait.
  if (copied_by_steps > 0) {
    EXPECT_GT(ss.snapshot_wait_us_total(), 0);
  }
  EXPECT_LE(ss.snapshot_wait_us_max(), ss.snapshot_wait_us_total());

  // Replay: a second session with the same weights and gradients steps to
  // each file's step count; its state then must equal the file's, bitwise.
  dos_session* r = nullptr;
  ASSERT_EQ(AttachClient(d.socket(), "cow_replay", &r), DOS_OK) << dos_last_error();
  dos_hparams hr;
  RegisterProbe(r, n, subgroup, &hr);
  ASSERT_FALSE(HasFatalFailure());
  std::sort(files.begin(), files.end(),
            [](const auto& a, const auto& b) { return a.step() < b.step(); });
  std::vector<float> want(3 * n), got(3 * n);
  auto read = [&](std::vector<float>* out, int64_t* step) {
    ASSERT_EQ(dos_state_read(r, 0, out->data(), out->data() + n, out->data() + 2 * n, step),
              DOS_OK)
        << dos_last_error();
  };
  int64_t at = 0;
  for (const auto& f : files) {
    dos_step_args a;
    dos_step_args_init(&a);
    a.groups = &hr;
    a.num_groups = 1;
    dos_step_result res;
    for (; at < f.step(); ++at) ASSERT_EQ(dos_step(r, &a, &res), DOS_OK) << dos_last_error();
    int64_t want_step = 0;
    int64_t got_step = 0;
    read(&want, &want_step);
    ASSERT_EQ(want_step, f.step());
    v1::LoadCheckpointRequest lreq;
    lreq.mutable_session()->set_session_id(dos_session_id(r));
    lreq.set_path(f.path());
    v1::LoadCheckpointResponse lresp;
    grpc::ClientContext lctx;
    grpc::Status st = stub->LoadCheckpoint(&lctx, lreq, &lresp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    read(&got, &got_step);
    EXPECT_EQ(got_step, f.step());
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
        << "checkpoint " << f.path() << " is not the state at step " << f.step();
  }
  EXPECT_EQ(dos_detach(r), DOS_OK);
  EXPECT_EQ(dos_detach(s), DOS_OK);
  EXPECT_EQ(d.Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(StagingLimits, CheckpointCopyOnWriteTest,
                         ::testing::Values("auto", "0", "12M"), [](const auto& info) {
                           return info.param == "auto" ? std::string("Default")
                                  : info.param == "0"  ? std::string("NoCopies")
                                                       : std::string("TwoSubgroups");
                         });

}  // namespace
}  // namespace dos::testing
