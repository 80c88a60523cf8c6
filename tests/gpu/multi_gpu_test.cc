// Several GPUs, one dosd (ctest label `gpu`): the daemon runs one GPU engine
// per device (--gpu_devices=all) and binds each session to the engine of the
// device its CUDA IPC memory lives on. Two trainer processes (ranks), on
// devices 0 and 1, attach to one dosd, register, are listed on their devices
// (ListSessions, GetStats), and then step at the same time; each checks that
// its GPU session reached its CPU-mode reference (gpu_rank_trainer.cc).
// Skipped, with a message, where fewer than two CUDA devices are visible.
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/support/daemon_process.h"

namespace dos {
namespace {

int VisibleGpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();
  return n;
}

std::string Uuid(int device) { return testing::DeviceUuid(device); }

std::string TrainerPath() {
  const char* env = std::getenv("DOS_GPU_RANK_TRAINER");
  return env != nullptr ? env : DOS_GPU_RANK_TRAINER_PATH;
}

// One rank's process, with its stdin and stdout on pipes.
struct Rank {
  pid_t pid = -1;
  int to_child = -1;    // write end of its stdin
  FILE* from_child = nullptr;  // its stdout
};

Rank Spawn(const std::string& socket, int device, int steps, const char* policy) {
  int in[2], out[2];
  Rank r;
  if (::pipe(in) != 0 || ::pipe(out) != 0) return r;
  r.pid = ::fork();
  if (r.pid == 0) {
    ::dup2(in[0], STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::close(in[1]);
    ::close(out[0]);
    const std::string path = TrainerPath();
    const std::string dev = std::to_string(device), n = std::to_string(steps);
    ::execl(path.c_str(), path.c_str(), socket.c_str(), dev.c_str(), n.c_str(), policy, nullptr);
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  r.to_child = in[1];
  r.from_child = ::fdopen(out[0], "r");
  return r;
}

// The child's stdout up to and including "registered" (or EOF).
bool WaitRegistered(Rank& r, std::string* seen) {
  char line[512];
  while (std::fgets(line, sizeof line, r.from_child) != nullptr) {
    *seen += line;
    if (std::string(line) == "registered\n") return true;
  }
  return false;
}

int Finish(Rank& r, std::string* seen) {
  char line[512];
  while (std::fgets(line, sizeof line, r.from_child) != nullptr) *seen += line;
  std::fclose(r.from_child);
  ::close(r.to_child);
  int status = 0;
  if (::waitpid(r.pid, &status, 0) != r.pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class MultiGpuTest : public ::testing::TestWithParam<const char*> {};

TEST_P(MultiGpuTest, TwoRanksOnTwoGpusShareOneDaemon) {
  const int gpus = VisibleGpus();
  if (gpus < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, " << gpus
                 << " visible: multi-GPU test skipped (run it on a 2-GPU machine)";
  }
  ASSERT_EQ(::access(TrainerPath().c_str(), X_OK), 0) << TrainerPath();
  testing::DaemonProcess daemon({"--gpu_devices=all", "--session_lease=0"});
  ASSERT_TRUE(daemon.Start()) << daemon.log();
  constexpr int kSteps = 30;
  Rank ranks[2];
  std::string out[2];
  for (int d = 0; d < 2; ++d) ranks[d] = Spawn(daemon.socket(), d, kSteps, GetParam());
  for (int d = 0; d < 2; ++d) {
    ASSERT_GT(ranks[d].pid, 0);
    EXPECT_TRUE(WaitRegistered(ranks[d], &out[d]))
        << "rank on cuda:" << d << " did not register:\n" << out[d] << daemon.log();
  }

  // Both registered: each GPU session runs on its own device's engine.
  auto stub = v1::Dos::NewStub(grpc::CreateChannel(absl::StrCat("unix:", daemon.socket()),
                                                   grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(stub->ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok());
    std::map<std::string, std::pair<std::string, std::string>> by_name;
    for (const auto& s : list.sessions()) by_name[s.client_name()] = {s.device(), s.device_uuid()};
    for (int d = 0; d < 2; ++d) {
      const std::string name = absl::StrCat("multi_gpu.rank", d);
      EXPECT_EQ(by_name[name].first, absl::StrCat("cuda:", d)) << name;
      EXPECT_EQ(by_name[name].second, Uuid(d)) << name;
      EXPECT_EQ(by_name[name + ".ref"].first, "host") << name;
    }
  }
  {
    grpc::ClientContext ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    ASSERT_EQ(stats.gpu_engines_size(), gpus);
    for (int d = 0; d < 2; ++d) {
      EXPECT_EQ(stats.gpu_engines(d).ordinal(), d);
      EXPECT_EQ(stats.gpu_engines(d).uuid(), Uuid(d));
      EXPECT_EQ(stats.gpu_engines(d).sessions(), 1u);
    }
  }

  // Release both ranks at once: their steps run concurrently on the two engines.
  for (Rank& r : ranks) EXPECT_EQ(::write(r.to_child, "g", 1), 1);
  for (int d = 0; d < 2; ++d) {
    const int rc = Finish(ranks[d], &out[d]);
    std::printf("rank on cuda:%d (%s):\n%s", d, GetParam(), out[d].c_str());
    EXPECT_EQ(rc, 0) << "rank on cuda:" << d << " exit " << rc
                     << " (10: not equal to CPU mode within tolerance; see its stderr above)\n"
                     << daemon.log();
  }
  // The node's shared model (node_resources.h): each engine planned its last
  // step with a share of the host and predicted it; with equal shards
  // stepping together, at least the later rank's plans split the host in two.
  {
    grpc::ClientContext ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    ASSERT_TRUE(stats.has_node());
    EXPECT_GT(stats.node().host_gbps(), 0);
    bool halved = false;
    for (int d = 0; d < 2; ++d) {
      const v1::GpuEngineInfo& e = stats.gpu_engines(d);
      EXPECT_GT(e.params(), 0u) << "cuda:" << d;
      EXPECT_GT(e.predicted_us(), 0) << "cuda:" << d;
      EXPECT_GT(e.measured_us(), 0) << "cuda:" << d;
      EXPECT_GT(e.planned_share(), 0) << "cuda:" << d;
      EXPECT_LE(e.planned_share(), 1) << "cuda:" << d;
      halved = halved || e.planned_share() == 0.5;
      std::printf("cuda:%d: share %.2f, predicted %.0f us, measured %.0f us (%s)\n", d,
                  e.planned_share(), e.predicted_us(), e.measured_us(), e.binding().c_str());
    }
    EXPECT_TRUE(halved) << "two equal ranks stepping together: one should plan with half the host";
  }
  EXPECT_EQ(daemon.Stop(), 0) << daemon.log();
}

INSTANTIATE_TEST_SUITE_P(Policies, MultiGpuTest,
                         ::testing::Values("interleave:2", "auto", "static:0.5"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (c == ':' || c == '.') c = '_';
                           }
                           return s;
                         });

}  // namespace
}  // namespace dos
