// GPU mode end to end (ctest label `gpu`): the real dosd, a trainer's CUDA
// memory shared by CUDA IPC through libdos_client (and, for malformed
// requests the client would never send, raw gRPC).
//  - registration errors: another device's UUID, a range past the end of its
//    allocation, an unsupported dtype (daemon), and a range past the end of
//    its allocation caught by the client;
//  - 50 steps under every policy reach the state of the same steps run in
//    CPU mode (shared memory, the CPU kernel that the unit tests check
//    against a double-precision reference), within fp32 rounding (values that
//    are not bitwise equal are counted on stdout);
//  - a trainer killed with a step in flight leaves the daemon healthy;
//  - one trainer's backward (its event not yet reached) holds up no other
//    session's step on the same GPU, and dosd sleeps while it waits for it.
// Skipped, with a message, where no CUDA device is visible.
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "dos/wire/dtype.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/support/daemon_process.h"

namespace dos {
namespace {

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(cudaGetLastError())

using testing::Bytes;
using testing::FillValues;
using testing::Layout;

std::string Uuid() { return testing::DeviceUuid(0); }

std::string TrainerPath() {
  const char* env = std::getenv("DOS_GPU_DOOMED_TRAINER");
  return env != nullptr ? env : DOS_GPU_DOOMED_TRAINER_PATH;
}

class GpuIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: GPU tests skipped";
    ASSERT_TRUE(daemon_.Start()) << daemon_.log();
    CK(cudaSetDevice(0));
  }
  void TearDown() override {
    for (void* p : device_) cudaFree(p);
    if (daemon_.pid() > 0 && HaveGpu()) {
      EXPECT_EQ(daemon_.Stop(), 0) << daemon_.log();
    }
  }

  void* DeviceAlloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);
    device_.push_back(p);
    return p;
  }

  dos_session* Attach(const char* name) {
    dos_attach_options o;
    dos_attach_options_init(&o);
    o.socket_path = daemon_.socket().c_str();
    o.client_name = name;
    dos_session* s = nullptr;
    EXPECT_EQ(dos_attach(&o, &s), DOS_OK) << dos_last_error();
    return s;
  }

  // Registers with `s` one bf16 tensor of `n` elements in fresh device
  // memory (weights FillValues(seed_w, 0.5), gradients FillValues(seed_g,
  // 0.02)) in subgroups of 2^18 under `h`. Call it in ASSERT_NO_FATAL_FAILURE.
  void RegisterBf16(dos_session* s, uint64_t n, uint32_t seed_w, uint32_t seed_g,
                    const dos_hparams& h) {
    const Layout layout{DOS_DTYPE_BF16, n};
    std::vector<char> host(n * 2);
    void* w = DeviceAlloc(n * 2);
    void* g = DeviceAlloc(n * 2);
    FillValues(layout, seed_w, 0.5f, host.data());
    CK(cudaMemcpy(w, host.data(), n * 2, cudaMemcpyHostToDevice));
    FillValues(layout, seed_g, 0.02f, host.data());
    CK(cudaMemcpy(g, host.data(), n * 2, cudaMemcpyHostToDevice));
    dos_register_options ro{.subgroup_size = 1 << 18};
    dos_tensor t{"w", DOS_DTYPE_BF16, w, DOS_DTYPE_BF16, g, n, 0};
    ASSERT_EQ(dos_register(s, &t, 1, &h, 1, &ro), DOS_OK) << dos_last_error();
  }

  std::unique_ptr<v1::Dos::Stub> Stub() {
    return v1::Dos::NewStub(grpc::CreateChannel(absl::StrCat("unix:", daemon_.socket()),
                                                grpc::InsecureChannelCredentials()));
  }

  // RegisterShard with one bf16 tensor of `numel` elements at the start of a
  // fresh cudaMalloc'd allocation, then `mutate` applied to the request.
  template <typename Fn>
  grpc::Status RawRegister(uint64_t numel, Fn mutate) {
    void* w = DeviceAlloc(numel * 2);
    void* g = DeviceAlloc(numel * 2);
    auto stub = Stub();
    v1::AttachRequest areq;
    areq.set_client_name("gpu_ipc_test.raw");
    areq.set_pid(::getpid());
    areq.set_rank(-1);
    areq.set_world_size(1);
    areq.set_protocol_version(kProtocolVersion);
    areq.set_fd_ticket(testing::FdTicket(daemon_.socket()));
    v1::AttachResponse aresp;
    {
      grpc::ClientContext ctx;
      grpc::Status s = stub->Attach(&ctx, areq, &aresp);
      if (!s.ok()) return s;
    }
    v1::RegisterShardRequest req;
    *req.mutable_session() = aresp.session();
    auto* h = req.add_groups();
    h->set_lr(1e-3);
    h->set_beta1(0.9);
    h->set_beta2(0.999);
    h->set_eps(1e-8);
    h->set_decoupled_weight_decay(true);
    auto* t = req.add_tensors();
    t->set_name("w");
    t->set_param_dtype(v1::DTYPE_BF16);
    t->set_grad_dtype(v1::DTYPE_BF16);
    t->set_numel(numel);
    for (auto [loc, ptr] : {std::pair{t->mutable_param(), w}, std::pair{t->mutable_grad(), g}}) {
      cudaIpcMemHandle_t handle;
      EXPECT_EQ(cudaIpcGetMemHandle(&handle, ptr), cudaSuccess);
      auto* c = loc->mutable_cuda_ipc();
      c->set_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof handle));
      c->set_offset(0);
      c->set_alloc_bytes(numel * 2);
      c->set_device_uuid(Uuid());
    }
    mutate(req);
    v1::RegisterShardResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    v1::DetachRequest dreq;
    *dreq.mutable_session() = aresp.session();
    v1::DetachResponse dresp;
    grpc::ClientContext dctx;
    stub->Detach(&dctx, dreq, &dresp);
    return st;
  }

  // --session_lease=0: a killed trainer's session is freed at once (the lease and
  // resume are tested in tests/fault/crash_survival_test.cc).
  testing::DaemonProcess daemon_{{"--session_lease=0"}};
  std::vector<void*> device_;
};

TEST_F(GpuIpcTest, RawRegistrationSucceedsWithMatchingDevice) {
  grpc::Status s = RawRegister(4096, [](v1::RegisterShardRequest&) {});
  EXPECT_TRUE(s.ok()) << s.error_message() << daemon_.log();
}

TEST_F(GpuIpcTest, WrongDeviceUuidIsRejected) {
  grpc::Status s = RawRegister(4096, [](v1::RegisterShardRequest& r) {
    for (auto* loc : {r.mutable_tensors(0)->mutable_param(), r.mutable_tensors(0)->mutable_grad()}) {
      loc->mutable_cuda_ipc()->set_device_uuid("GPU-00000000-1111-2222-3333-444444444444");
    }
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("GPU-00000000-1111-2222-3333-444444444444"), std::string::npos)
      << s.error_message();
}

TEST_F(GpuIpcTest, RegionBeyondAllocationIsRejected) {
  grpc::Status s = RawRegister(4096, [](v1::RegisterShardRequest& r) {
    r.mutable_tensors(0)->mutable_param()->mutable_cuda_ipc()->set_offset(4096);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("outside its CUDA allocation"), std::string::npos)
      << s.error_message();
}

TEST_F(GpuIpcTest, UnsupportedDtypeIsRejected) {
  grpc::Status s = RawRegister(4096, [](v1::RegisterShardRequest& r) {
    r.mutable_tensors(0)->set_grad_dtype(static_cast<v1::DType>(9));
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("dtype"), std::string::npos) << s.error_message();
}

TEST_F(GpuIpcTest, ClientRejectsRangeBeyondAllocation) {
  ASSERT_EQ(dos_cuda_supported(), 1);
  void* w = DeviceAlloc(1 << 20);
  void* g = DeviceAlloc(1 << 20);
  dos_session* s = Attach("gpu_ipc_test.range");
  // Interior pointer, 1 KiB before the end, 4 KiB long.
  dos_tensor t{"w", DOS_DTYPE_F32, static_cast<char*>(w) + (1 << 20) - 1024, DOS_DTYPE_F32, g,
               1024, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  EXPECT_EQ(dos_register(s, &t, 1, &h, 1, nullptr), DOS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dos_last_error()).find("CUDA allocation"), std::string::npos)
      << dos_last_error();
  // An interior pointer that fits is fine.
  t.param = static_cast<char*>(w) + 4096;
  EXPECT_EQ(dos_register(s, &t, 1, &h, 1, nullptr), DOS_OK) << dos_last_error();
  EXPECT_EQ(dos_detach(s), DOS_OK);
}

// Tensors of every dtype and awkward sizes, several per allocation.
const Layout kTensors[] = {{DOS_DTYPE_BF16, 100003}, {DOS_DTYPE_F32, 7777},
                           {DOS_DTYPE_F16, 50001},   {DOS_DTYPE_BF16, 1},
                           {DOS_DTYPE_BF16, 65536}};


TEST_F(GpuIpcTest, FiftyStepsUnderEveryPolicyMatchCpuMode) {
  constexpr int kSteps = 50;
  const size_t n = std::size(kTensors);
  uint64_t total = 0;
  std::vector<uint64_t> offset;
  for (const Layout& l : kTensors) {
    offset.push_back(total);
    total += (Bytes(l) + 255) / 256 * 256;
  }
  // Reference: CPU mode (shared memory), the CPU path.
  dos_session* ref = Attach("gpu_ipc_test.ref");
  void *rw = nullptr, *rg = nullptr;
  ASSERT_EQ(dos_buffer_alloc(ref, total, &rw), DOS_OK);
  ASSERT_EQ(dos_buffer_alloc(ref, total, &rg), DOS_OK);
  std::vector<dos_tensor> rt;
  for (size_t i = 0; i < n; ++i) {
    FillValues(kTensors[i], 1000 + i, 0.5f, static_cast<char*>(rw) + offset[i]);
    rt.push_back({"t", kTensors[i].dtype, static_cast<char*>(rw) + offset[i], kTensors[i].dtype,
                  static_cast<char*>(rg) + offset[i], kTensors[i].numel, 0});
  }
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  h.lr = 3e-3;
  h.weight_decay = 0.05;
  dos_register_options ro{.subgroup_size = 32768};
  ASSERT_EQ(dos_register(ref, rt.data(), n, &h, 1, &ro), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_set_policy(ref, "cpu"), DOS_OK);

  const char* policies[] = {"cpu", "static:0.5", "interleave:2", "interleave:3", "auto"};
  std::vector<dos_session*> gpu;
  std::vector<char*> dw, dg;
  for (const char* policy : policies) {
    dos_session* s = Attach(policy);
    char* w = static_cast<char*>(DeviceAlloc(total));
    char* g = static_cast<char*>(DeviceAlloc(total));
    CK(cudaMemcpy(w, rw, total, cudaMemcpyHostToDevice));
    std::vector<dos_tensor> t = rt;
    for (size_t i = 0; i < n; ++i) {
      t[i].param = w + offset[i];
      t[i].grad = g + offset[i];
    }
    ASSERT_EQ(dos_register(s, t.data(), n, &h, 1, &ro), DOS_OK) << policy << ": "
                                                                 << dos_last_error();
    ASSERT_EQ(dos_set_policy(s, policy), DOS_OK) << dos_last_error();
    gpu.push_back(s);
    dw.push_back(w);
    dg.push_back(g);
  }
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  for (int step = 1; step <= kSteps; ++step) {
    for (size_t i = 0; i < n; ++i) {
      FillValues(kTensors[i], step * 97 + i, 0.02f, static_cast<char*>(rg) + offset[i]);
    }
    dos_step_result r;
    ASSERT_EQ(dos_step(ref, &a, &r), DOS_OK) << dos_last_error();
    for (size_t k = 0; k < gpu.size(); ++k) {
      CK(cudaMemcpy(dg[k], rg, total, cudaMemcpyHostToDevice));
      ASSERT_EQ(dos_step(gpu[k], &a, &r), DOS_OK) << policies[k] << ": " << dos_last_error();
      ASSERT_EQ(r.step, step);
    }
  }
  std::vector<char> host(total);
  for (size_t k = 0; k < gpu.size(); ++k) {
    CK(cudaMemcpy(host.data(), dw[k], total, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      // 16-bit weights: at most one unit in the last place apart (the fp32
      // masters below may differ by ulps, which can flip a rounding).
      const char* gw = host.data() + offset[i];
      const char* cw = static_cast<char*>(rw) + offset[i];
      size_t wdiff = 0;
      int worst_units = 0;
      for (uint64_t e = 0; e < kTensors[i].numel; ++e) {
        if (kTensors[i].dtype == DOS_DTYPE_F32) {
          float a, b;
          std::memcpy(&a, gw + 4 * e, 4);
          std::memcpy(&b, cw + 4 * e, 4);
          wdiff += a != b;
        } else {
          int16_t a, b;
          std::memcpy(&a, gw + 2 * e, 2);
          std::memcpy(&b, cw + 2 * e, 2);
          wdiff += a != b;
          worst_units = std::max(worst_units, std::abs(int{a} - int{b}));
        }
      }
      EXPECT_LE(worst_units, 1) << policies[k] << ": tensor " << i;
      if (wdiff > 0) {
        std::printf("%s: tensor %zu: %zu of %llu weights not bitwise equal to CPU mode\n",
                    policies[k], i, wdiff, static_cast<unsigned long long>(kTensors[i].numel));
      }
      const uint64_t m = kTensors[i].numel;
      std::vector<float> a_state(3 * m), b_state(3 * m);
      int64_t sa = 0, sb = 0;
      ASSERT_EQ(dos_state_read(gpu[k], i, a_state.data(), a_state.data() + m,
                               a_state.data() + 2 * m, &sa), DOS_OK) << dos_last_error();
      ASSERT_EQ(dos_state_read(ref, i, b_state.data(), b_state.data() + m, b_state.data() + 2 * m,
                               &sb), DOS_OK) << dos_last_error();
      EXPECT_EQ(sa, kSteps);
      EXPECT_EQ(sb, kSteps);
      // Tolerance as tests/python/test_equivalence.py, per state array:
      // |a - b| <= 1e-5 |b| + 1e-5 max|b| (the GPU and CPU kernels round
      // alike operation by operation, but a CPU variant may differ by an ulp;
      // m crossing zero makes relative differences alone meaningless).
      const char* part[3] = {"master", "exp_avg", "exp_avg_sq"};
      size_t diff = 0;
      for (int w = 0; w < 3; ++w) {
        const float* av = a_state.data() + w * m;
        const float* bv = b_state.data() + w * m;
        double scale = 0;
        for (uint64_t e = 0; e < m; ++e) scale = std::max(scale, std::abs(double(bv[e])));
        size_t bad = 0;
        double worst = 0;
        for (uint64_t e = 0; e < m; ++e) {
          if (std::memcmp(av + e, bv + e, 4) == 0) continue;
          ++diff;
          const double d = std::abs(double(av[e]) - bv[e]);
          worst = std::max(worst, d / (scale > 0 ? scale : 1));
          if (!(d <= 1e-5 * std::abs(double(bv[e])) + 1e-5 * scale)) ++bad;
        }
        EXPECT_EQ(bad, 0u) << policies[k] << ": tensor " << i << " " << part[w] << ": " << bad
                           << " of " << m << " values outside the tolerance (worst difference "
                           << worst << " of the array's max)";
      }
      if (diff > 0) {
        std::printf("%s: tensor %zu: %zu of %llu fp32 state values not bitwise equal to CPU mode\n",
                    policies[k], i, diff, static_cast<unsigned long long>(3 * m));
      }
    }
    EXPECT_EQ(dos_detach(gpu[k]), DOS_OK);
  }
  EXPECT_EQ(dos_detach(ref), DOS_OK);
}

int Sessions(v1::Dos::Stub* stub) {
  grpc::ClientContext ctx;
  v1::ListSessionsRequest req;
  v1::ListSessionsResponse resp;
  if (!stub->ListSessions(&ctx, req, &resp).ok()) return -1;
  return resp.sessions_size();
}

TEST_F(GpuIpcTest, TrainerKilledMidStepLeavesDaemonHealthy) {
  const std::string trainer = TrainerPath();
  ASSERT_EQ(::access(trainer.c_str(), X_OK), 0) << trainer;
  pid_t child = ::fork();
  if (child == 0) {
    ::execl(trainer.c_str(), trainer.c_str(), daemon_.socket().c_str(), nullptr);
    ::_exit(127);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "gpu_doomed_trainer exit status " << status << "\n" << daemon_.log();
  // The daemon notices the death, finishes or abandons the step and frees
  // the session.
  auto stub = Stub();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int sessions = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    sessions = Sessions(stub.get());
    if (sessions == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(sessions, 0) << daemon_.log();
  ASSERT_EQ(::kill(daemon_.pid(), 0), 0) << "dosd died\n" << daemon_.log();
  // A new GPU session trains normally.
  constexpr uint64_t kN = 1 << 20;
  void* w = DeviceAlloc(kN * 2);
  void* g = DeviceAlloc(kN * 2);
  dos_session* s = Attach("gpu_ipc_test.survivor");
  dos_tensor t{"w", DOS_DTYPE_BF16, w, DOS_DTYPE_BF16, g, kN, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  dos_register_options ro{.subgroup_size = 1 << 18};
  ASSERT_EQ(dos_register(s, &t, 1, &h, 1, &ro), DOS_OK) << dos_last_error();
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  for (int i = 1; i <= 3; ++i) {
    dos_step_result r;
    ASSERT_EQ(dos_step(s, &a, &r), DOS_OK) << dos_last_error();
    EXPECT_EQ(r.step, i);
  }
  EXPECT_EQ(dos_detach(s), DOS_OK);
}

// The GPU engine runs one step at a time for every session on the device, on
// streams they share. A session whose step waits for its trainer's backward
// must not hold up another session's steps on the same GPU meanwhile: a
// stream-ordered step waiting for its trainer's event (backward still running:
// here a host function that sleeps on the trainer's stream), and an early step
// without a verdict whose subgroups are marked ready only two seconds later.
void SleepTwoSeconds(void*) { ::usleep(2'000'000); }

enum class SlowStep { kStreamOrdered, kPerSubgroup };
const char* SlowStepName(SlowStep s) {
  return s == SlowStep::kStreamOrdered ? "StreamOrdered" : "PerSubgroup";
}
void PrintTo(SlowStep s, std::ostream* os) { *os << SlowStepName(s); }

class GpuSharedTest : public GpuIpcTest, public ::testing::WithParamInterface<SlowStep> {};

TEST_P(GpuSharedTest, OneTrainersBackwardHoldsUpNoOtherSessionsStep) {
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  dos_session* sessions[2] = {Attach("gpu_ipc_test.slow"), Attach("gpu_ipc_test.other")};
  for (uint32_t k = 0; k < 2; ++k) {
    ASSERT_NO_FATAL_FAILURE(RegisterBf16(sessions[k], 1 << 20, 10 + k, 20 + k, h));
  }
  dos_session* slow = sessions[0];
  dos_session* other = sessions[1];
  ASSERT_EQ(dos_stream_sync_supported(slow), 1) << "the GPU session has no interprocess event";
  dos_step_result r;
  for (dos_session* s : sessions) ASSERT_EQ(dos_step(s, &a, &r), DOS_OK) << dos_last_error();
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto begun = std::chrono::steady_clock::now();
  std::thread finisher;
  if (GetParam() == SlowStep::kStreamOrdered) {
    CK(cudaLaunchHostFunc(stream, SleepTwoSeconds, nullptr));
    ASSERT_EQ(dos_step_begin_on_stream(slow, &a, stream), DOS_OK) << dos_last_error();
  } else {
    ASSERT_EQ(dos_step_begin_early(slow, &a, DOS_EARLY_NO_VERDICT, stream), DOS_OK)
        << dos_last_error();
    finisher = std::thread([&] {  // backward ends after two seconds
      std::this_thread::sleep_for(std::chrono::seconds(2));
      EXPECT_EQ(dos_step_verdict(slow, nullptr, stream), DOS_OK) << dos_last_error();
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // dosd is in its wait by now
  double worst_ms = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(dos_step(other, &a, &r), DOS_OK) << dos_last_error();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("the other session's step %d: %.1f ms while the slow trainer's backward runs\n",
                i + 1, ms);
    worst_ms = std::max(worst_ms, ms);
  }
  if (finisher.joinable()) finisher.join();
  ASSERT_EQ(dos_step_wait(slow, 30000, &r), DOS_OK) << dos_last_error();
  const double slow_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begun).count();
  EXPECT_EQ(r.step, 2);
  // The slow step really waited for its trainer's backward...
  EXPECT_GE(slow_ms, 1500) << "the slow session's step did not wait for its trainer";
  // ...and the other session's steps went on meanwhile (each takes a few ms;
  // held up, the first would take the rest of the two seconds).
  EXPECT_LT(worst_ms, 1000) << "another session's step waited for the slow trainer's backward";
  CK(cudaStreamSynchronize(stream));
  CK(cudaStreamDestroy(stream));
  for (dos_session* s : sessions) EXPECT_EQ(dos_detach(s), DOS_OK);
}

INSTANTIATE_TEST_SUITE_P(Slow, GpuSharedTest,
                         ::testing::Values(SlowStep::kStreamOrdered, SlowStep::kPerSubgroup),
                         [](const ::testing::TestParamInfo<SlowStep>& p) {
                           return std::string(SlowStepName(p.param));
                         });

// dosd's CPU time so far, user and system, in seconds (/proc/PID/stat).
double CpuSeconds(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const char* p = std::strrchr(buf, ')');  // the command may hold spaces
  if (n == 0 || p == nullptr) return -1;
  unsigned long utime = 0, stime = 0;  // fields 14 and 15, after state (3) and 10 more
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime, &stime) !=
      2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// While dosd waits on the host for a trainer's backward (its event not yet
// reached), the waiting thread sleeps: cudaEventSynchronize on an event
// without cudaEventBlockingSync busy-waits whatever the device's flags, and
// a core spun for as long as backward runs is one the trainer's launch
// threads lack beside the delayed update's.
TEST_F(GpuIpcTest, DosdSleepsWhileItWaitsForTheTrainersBackward) {
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  dos_session* s = Attach("gpu_ipc_test.sleeps");
  ASSERT_NO_FATAL_FAILURE(RegisterBf16(s, 1 << 20, 31, 32, h));
  ASSERT_EQ(dos_stream_sync_supported(s), 1) << "the GPU session has no interprocess event";
  dos_step_result r;
  ASSERT_EQ(dos_step(s, &a, &r), DOS_OK) << dos_last_error();
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(cudaLaunchHostFunc(stream, SleepTwoSeconds, nullptr));  // "backward": two seconds
  ASSERT_EQ(dos_step_begin_on_stream(s, &a, stream), DOS_OK) << dos_last_error();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // dosd is in its wait by now
  const double before = CpuSeconds(daemon_.pid());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const double used = CpuSeconds(daemon_.pid()) - before;
  std::printf("dosd used %.2f s of CPU in 1.5 s of waiting for the trainer's event\n", used);
  ASSERT_GE(before, 0) << "cannot read /proc/" << daemon_.pid() << "/stat";
  EXPECT_LT(used, 0.5) << "dosd spins while it waits for the trainer (a busy-wait takes 1.5 s)";
  ASSERT_EQ(dos_step_wait(s, 30000, &r), DOS_OK) << dos_last_error();
  EXPECT_EQ(r.step, 2);
  CK(cudaStreamSynchronize(stream));
  CK(cudaStreamDestroy(stream));
  EXPECT_EQ(dos_detach(s), DOS_OK);
}
}  // namespace
}  // namespace dos
