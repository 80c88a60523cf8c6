// End-to-end tests of the real dosd binary, driven only through the client
// library's C ABI and gRPC, as users and operators drive it.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/cpu/adam_kernel.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "dos/wire/dtype.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "tests/support/daemon_fixture.h"

namespace dos::testing {
namespace {

// A trainer's view of one shard: tensors in shared memory, plus a local
// model of what the daemon must compute, using the scalar kernel (the daemon
// runs with --cpu_isa=scalar here, so results must match bit for bit).
class FakeTrainer {
 public:
  struct Tensor {
    dos_dtype dtype = DOS_DTYPE_F32;
    uint64_t numel = 0;
    uint32_t group = 0;
    void* param = nullptr;
    void* grad = nullptr;
    std::vector<float> master, m, v;
    int64_t step = 0;
  };

  explicit FakeTrainer(uint32_t seed) : rng_(seed) {}

  dos_status Attach(const std::string& socket) {
    return AttachClient(socket, "daemon_test", &session_);
  }
  ~FakeTrainer() { dos_detach(session_); }

  void AddTensor(dos_dtype dtype, uint64_t numel, uint32_t group) {
    Tensor t;
    t.dtype = dtype;
    t.numel = numel;
    t.group = group;
    size_t esize = dtype == DOS_DTYPE_F32 ? 4 : 2;
    ASSERT_EQ(dos_buffer_alloc(session_, numel * esize, &t.param), DOS_OK) << dos_last_error();
    ASSERT_EQ(dos_buffer_alloc(session_, numel * esize, &t.grad), DOS_OK) << dos_last_error();
    std::normal_distribution<float> dist(0.0f, 0.5f);
    t.master.resize(numel);
    t.m.assign(numel, 0.0f);
    t.v.assign(numel, 0.0f);
    for (uint64_t i = 0; i < numel; ++i) {
      float x = dist(rng_);
      Store(t.dtype, t.param, i, x);
      t.master[i] = Load(t.dtype, t.param, i);  // the master starts from the trainer's weight
    }
    tensors_.push_back(std::move(t));
  }

  dos_status Register(std::vector<dos_hparams> groups, uint64_t subgroup_size) {
    groups_ = groups;
    std::vector<dos_tensor> specs;
    for (auto& t : tensors_) {
      specs.push_back(dos_tensor{"t", t.dtype, t.param, t.dtype, t.grad, t.numel, t.group});
    }
    dos_register_options ro{subgroup_size};
    return dos_register(session_, specs.data(), specs.size(), groups.data(), groups.size(), &ro);
  }

  void FillGradients() {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (auto& t : tensors_) {
      for (uint64_t i = 0; i < t.numel; ++i) Store(t.dtype, t.grad, i, dist(rng_));
    }
  }

  dos_status Step(double grad_scale, double clip, dos_step_result* r) {
    dos_step_args a;
    dos_step_args_init(&a);
    a.groups = groups_.data();
    a.num_groups = groups_.size();
    a.grad_scale = grad_scale;
    a.clip_coef = clip;
    return dos_step(session_, &a, r);
  }

  // Applies the step locally with the scalar kernel.
  void ExpectStep(double grad_scale, double clip) {
    cpu::AdamKernelFn kernel = cpu::AdamKernel(cpu::Isa::kScalar);
    for (auto& t : tensors_) {
      const dos_hparams& h = groups_[t.group];
      GroupStepParams g{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
      ++t.step;
      cpu::AdamScalars s = cpu::MakeAdamScalars(g, h.decoupled_weight_decay != 0, t.step,
                                                grad_scale, clip);
      cpu::AdamSpan span{t.grad,      static_cast<DType>(t.dtype), t.master.data(), t.m.data(),
                         t.v.data(),  nullptr,                     static_cast<DType>(t.dtype),
                         t.numel};
      kernel(s, span);
    }
  }

  // The trainer's weights equal the rounding of the expected masters, and
  // the daemon's state equals the expected state, bit for bit.
  void CheckAgainstDaemon() {
    for (uint32_t ti = 0; ti < tensors_.size(); ++ti) {
      Tensor& t = tensors_[ti];
      std::vector<float> p(t.numel), m(t.numel), v(t.numel);
      int64_t step = -1;
      ASSERT_EQ(dos_state_read(session_, ti, p.data(), m.data(), v.data(), &step), DOS_OK)
          << dos_last_error();
      EXPECT_EQ(step, t.step);
      for (uint64_t i = 0; i < t.numel; ++i) {
        ASSERT_EQ(p[i], t.master[i]) << "tensor " << ti << " element " << i;
        ASSERT_EQ(m[i], t.m[i]) << "tensor " << ti << " element " << i;
        ASSERT_EQ(v[i], t.v[i]) << "tensor " << ti << " element " << i;
        float expect_w = Load(t.dtype, &Rounded(t.dtype, t.master[i]), 0);
        ASSERT_EQ(Load(t.dtype, t.param, i), expect_w) << "tensor " << ti << " element " << i;
      }
    }
  }

  dos_session* session() { return session_; }
  std::vector<Tensor>& tensors() { return tensors_; }

  static float Load(dos_dtype d, const void* base, uint64_t i) {
    if (d == DOS_DTYPE_F32) return static_cast<const float*>(base)[i];
    uint16_t h = static_cast<const uint16_t*>(base)[i];
    return d == DOS_DTYPE_BF16 ? BF16ToFloat(h) : F16ToFloat(h);
  }
  static void Store(dos_dtype d, void* base, uint64_t i, float x) {
    if (d == DOS_DTYPE_F32) {
      static_cast<float*>(base)[i] = x;
    } else {
      static_cast<uint16_t*>(base)[i] = d == DOS_DTYPE_BF16 ? FloatToBF16(x) : FloatToF16(x);
    }
  }

 private:
  // Scratch for one rounded element (Load reads it back in the same dtype).
  uint32_t& Rounded(dos_dtype d, float x) {
    scratch_ = 0;
    Store(d, &scratch_, 0, x);
    return scratch_;
  }

  std::mt19937 rng_;
  dos_session* session_ = nullptr;
  std::vector<Tensor> tensors_;
  std::vector<dos_hparams> groups_;
  uint32_t scratch_ = 0;
};

dos_hparams AdamW(double lr, double wd) {
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  h.lr = lr;
  h.weight_decay = wd;
  return h;
}

// No lease: a dead client's state is freed at once (crash survival with a
// lease is tested in tests/fault/crash_survival_test.cc).
class DaemonTest : public DaemonFixture {
 protected:
  DaemonTest() : DaemonFixture({"--cpu_isa=scalar", "--cpu_threads=2", "--session_lease=0"}) {}
};

TEST_F(DaemonTest, TwoConcurrentClientsGetExactUpdates) {
  auto run_client = [&](uint32_t seed, dos_dtype dtype, bool decoupled) {
    FakeTrainer tr(seed);
    ASSERT_EQ(tr.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
    tr.AddTensor(dtype, 7, 0);
    tr.AddTensor(dtype, 2500, 1);
    tr.AddTensor(DOS_DTYPE_F32, 64, 0);
    tr.AddTensor(dtype, 1, 1);
    dos_hparams g0 = AdamW(1e-2, 0.1), g1 = AdamW(3e-3, 0.0);
    g0.decoupled_weight_decay = g1.decoupled_weight_decay = decoupled ? 1 : 0;
    g1.beta1 = 0.8;
    g1.beta2 = 0.99;
    g1.eps = 1e-6;
    // Subgroups of 1000 elements span tensor boundaries.
    ASSERT_EQ(tr.Register({g0, g1}, 1000), DOS_OK) << dos_last_error();
    for (int step = 0; step < 20; ++step) {
      tr.FillGradients();
      double scale = step % 3 == 0 ? 1024.0 : 1.0, clip = step % 2 ? 0.5 : 1.0;
      dos_step_result r;
      ASSERT_EQ(tr.Step(scale, clip, &r), DOS_OK) << dos_last_error();
      ASSERT_EQ(r.found_inf, 0);
      tr.ExpectStep(scale, clip);
      ASSERT_EQ(r.step, step + 1);
    }
    tr.CheckAgainstDaemon();
  };
  std::thread a([&] { run_client(1, DOS_DTYPE_BF16, true); });
  std::thread b([&] { run_client(2, DOS_DTYPE_F16, false); });
  run_client(3, DOS_DTYPE_F32, true);
  a.join();
  b.join();
}

TEST_F(DaemonTest, NonFiniteGradientSkipsTheWholeStep) {
  FakeTrainer tr(5);
  ASSERT_EQ(tr.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_BF16, 300, 0);
  tr.AddTensor(DOS_DTYPE_BF16, 300, 0);
  ASSERT_EQ(tr.Register({AdamW(1e-3, 0.01)}, 128), DOS_OK) << dos_last_error();
  tr.FillGradients();
  dos_step_result r;
  ASSERT_EQ(tr.Step(1, 1, &r), DOS_OK);
  tr.ExpectStep(1, 1);
  // One inf in the last tensor: nothing anywhere may change.
  tr.FillGradients();
  FakeTrainer::Store(DOS_DTYPE_BF16, tr.tensors()[1].grad, 299, INFINITY);
  ASSERT_EQ(tr.Step(1, 1, &r), DOS_OK);
  EXPECT_EQ(r.found_inf, 1);
  EXPECT_EQ(r.step, 1);
  tr.CheckAgainstDaemon();
  FakeTrainer::Store(DOS_DTYPE_BF16, tr.tensors()[0].grad, 0, NAN);
  ASSERT_EQ(tr.Step(1, 1, &r), DOS_OK);
  EXPECT_EQ(r.found_inf, 1);
  tr.CheckAgainstDaemon();
}

TEST_F(DaemonTest, StepBeforeRegisterAndDoubleRegisterAreRefused) {
  FakeTrainer tr(7);
  ASSERT_EQ(tr.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
  dos_hparams h = AdamW(1e-3, 0);
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  dos_step_result r;
  EXPECT_EQ(dos_step(tr.session(), &a, &r), DOS_FAILED_PRECONDITION);
  EXPECT_NE(std::string(dos_last_error()).find("register"), std::string::npos) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_F32, 10, 0);
  ASSERT_EQ(tr.Register({h}, 0), DOS_OK) << dos_last_error();
  EXPECT_EQ(tr.Register({h}, 0), DOS_FAILED_PRECONDITION);
  EXPECT_NE(std::string(dos_last_error()).find("already"), std::string::npos) << dos_last_error();
  // Wrong group count in a step.
  dos_hparams two[2] = {h, h};
  a.groups = two;
  a.num_groups = 2;
  EXPECT_EQ(dos_step(tr.session(), &a, &r), DOS_INVALID_ARGUMENT) << dos_last_error();
  // Bad hyperparameters name the field.
  two[0].beta2 = 1.5;
  a.num_groups = 1;
  EXPECT_EQ(dos_step(tr.session(), &a, &r), DOS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dos_last_error()).find("beta2"), std::string::npos) << dos_last_error();
}

TEST_F(DaemonTest, RawRpcBadInputGetsClearErrors) {
  auto stub = Stub();
  // Unknown session.
  {
    grpc::ClientContext ctx;
    v1::RegisterShardRequest req;
    v1::RegisterShardResponse resp;
    req.mutable_session()->set_session_id(999);
    req.mutable_session()->set_token("nope");
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  }
  // Attach, then wrong token, bad dtype, and a tensor overrunning its buffer.
  FakeTrainer tr(9);
  ASSERT_EQ(tr.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_F32, 16, 0);
  const std::string fd_socket = fdproto::SocketPathFor(daemon_.socket());
  v1::AttachRequest areq;
  areq.set_pid(getpid());
  areq.set_protocol_version(kProtocolVersion);
  v1::AttachResponse aresp;
  {
    // Without the descriptor socket's ticket, no session.
    grpc::ClientContext ctx;
    grpc::Status st = stub->Attach(&ctx, areq, &aresp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_NE(st.error_message().find("fd_ticket"), std::string::npos) << st.error_message();
  }
  {
    absl::StatusOr<std::string> ticket = fdproto::Hello(fd_socket);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    areq.set_fd_ticket(*ticket);
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Attach(&ctx, areq, &aresp).ok());
    EXPECT_TRUE(aresp.control_block_name().empty());
  }
  {
    // A ticket is single-use.
    grpc::ClientContext ctx;
    v1::AttachResponse again;
    EXPECT_EQ(stub->Attach(&ctx, areq, &again).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    // A name with a terminal escape would reach operators' dosctl sessions.
    v1::AttachRequest named = areq;
    absl::StatusOr<std::string> ticket = fdproto::Hello(fd_socket);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    named.set_fd_ticket(*ticket);
    named.set_client_name("job\x1b]0;owned\x07");
    grpc::ClientContext ctx;
    v1::AttachResponse refused;
    grpc::Status st = stub->Attach(&ctx, named, &refused);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("client_name has control character 0x1b at byte 3"),
              std::string::npos)
        << st.error_message();
  }
  auto make_req = [&]() {
    v1::RegisterShardRequest req;
    *req.mutable_session() = aresp.session();
    AddAdamGroup(&req);
    auto* t = req.add_tensors();
    t->set_name("w");
    t->set_param_dtype(v1::DTYPE_F32);
    t->set_grad_dtype(v1::DTYPE_F32);
    t->set_numel(16);
    t->mutable_param()->mutable_shm()->set_segment(12345);  // never sent
    t->mutable_grad()->mutable_shm()->set_segment(12345);
    return req;
  };
  {
    grpc::ClientContext ctx;
    auto req = make_req();
    req.mutable_session()->set_token("wrong");
    v1::RegisterShardResponse resp;
    EXPECT_EQ(stub->RegisterShard(&ctx, req, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    auto req = make_req();
    req.mutable_tensors(0)->set_grad_dtype(v1::DTYPE_UNSPECIFIED);
    v1::RegisterShardResponse resp;
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("tensors[0].grad_dtype"), std::string::npos)
        << st.error_message();
  }
  {
    // A gradients-ready CUDA event only goes with CUDA IPC tensors.
    grpc::ClientContext ctx;
    auto req = make_req();
    req.set_cuda_ipc_event(std::string(64, '\x01'));
    v1::RegisterShardResponse resp;
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("cuda_ipc_event"), std::string::npos)
        << st.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::RegisterShardResponse resp;
    grpc::Status st = stub->RegisterShard(&ctx, make_req(), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_NE(st.error_message().find("segment 12345"), std::string::npos)
        << st.error_message();
  }
  {
    // Memory by name is refused outright (dosd would open it with its rights).
    grpc::ClientContext ctx;
    auto req = make_req();
    req.mutable_tensors(0)->mutable_param()->mutable_shm()->set_name("/dos-by-name");
    v1::RegisterShardResponse resp;
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("by name"), std::string::npos) << st.error_message();
  }
  {
    // A real segment of 4096 bytes, but 16 fp32 grads claimed at offset 4048.
    auto seg = ShmSegment::Create("dos-it-small", 4096);
    ASSERT_TRUE(seg.ok()) << seg.status();
    const int fd = (*seg)->fd();
    absl::StatusOr<std::vector<uint64_t>> ids = fdproto::SendSegments(
        fd_socket, aresp.session().session_id(), aresp.session().token(), {&fd, 1});
    ASSERT_TRUE(ids.ok()) << ids.status();
    grpc::ClientContext ctx;
    auto req = make_req();
    req.mutable_tensors(0)->mutable_param()->mutable_shm()->set_segment((*ids)[0]);
    req.mutable_tensors(0)->mutable_grad()->mutable_shm()->set_segment((*ids)[0]);
    req.mutable_tensors(0)->mutable_grad()->mutable_shm()->set_offset(4048);
    v1::RegisterShardResponse resp;
    grpc::Status st = stub->RegisterShard(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("overruns"), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find("grad"), std::string::npos) << st.error_message();
  }
}

// Runs doomed_trainer (attach, register, one step, exit without detaching)
// against `socket` and waits for it; its pid in `pid`.
void RunDoomedTrainer(const std::string& socket, pid_t* pid = nullptr) {
  const pid_t child = fork();
  if (child == 0) {
    execl(DOS_DOOMED_TRAINER_PATH, DOS_DOOMED_TRAINER_PATH, socket.c_str(), nullptr);
    _exit(127);
  }
  if (pid != nullptr) *pid = child;
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(DaemonTest, ClientThatExitsMidSessionIsReapedOthersKeepWorking) {
  FakeTrainer survivor(11);
  ASSERT_EQ(survivor.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
  survivor.AddTensor(DOS_DTYPE_F32, 100, 0);
  ASSERT_EQ(survivor.Register({AdamW(1e-3, 0.0)}, 0), DOS_OK) << dos_last_error();

  ASSERT_NO_FATAL_FAILURE(RunDoomedTrainer(daemon_.socket()));

  // The reaper takes the session out of the list first and frees its state
  // after (joining its step thread, unmapping its memory): wait for both.
  auto stub = Stub();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int sessions = -1;
  uint64_t state_bytes = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    grpc::ClientContext ctx;
    v1::ListSessionsRequest req;
    v1::ListSessionsResponse resp;
    ASSERT_TRUE(stub->ListSessions(&ctx, req, &resp).ok());
    sessions = resp.sessions_size();
    grpc::ClientContext stats_ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub->GetStats(&stats_ctx, v1::GetStatsRequest(), &stats).ok());
    state_bytes = stats.host_state_bytes();
    // 100 parameters: one page-aligned subgroup.
    if (sessions == 1 && state_bytes == 4096u) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(sessions, 1) << daemon_.log();
  EXPECT_EQ(state_bytes, 4096u) << "the exited client's state was not freed";

  for (int i = 0; i < 3; ++i) {
    survivor.FillGradients();
    dos_step_result r;
    ASSERT_EQ(survivor.Step(1, 1, &r), DOS_OK) << dos_last_error();
    survivor.ExpectStep(1, 1);
  }
  survivor.CheckAgainstDaemon();
}

// Per-subgroup progress through the C ABI on the CPU path: each tensor's
// subgroup range, waits for ranges of the step in flight (before and after
// its result), and the errors for what a shared-memory session cannot do.
TEST_F(DaemonTest, SubgroupProgressAndStreamOrderedStepsOverTheCApi) {
  FakeTrainer tr(7);
  ASSERT_EQ(tr.Attach(daemon_.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_BF16, 2500, 0);  // subgroups 0..2 (1000 elements each)
  tr.AddTensor(DOS_DTYPE_F32, 700, 0);    // 2500..3199: subgroups 2..3
  tr.AddTensor(DOS_DTYPE_BF16, 1, 0);     // 3200: subgroup 3
  ASSERT_EQ(tr.Register({AdamW(1e-3, 0.01)}, 1000), DOS_OK) << dos_last_error();
  dos_session* s = tr.session();
  uint32_t first = 0, last = 0;
  const uint32_t want[3][2] = {{0, 2}, {2, 3}, {3, 3}};
  for (uint32_t t = 0; t < 3; ++t) {
    ASSERT_EQ(dos_tensor_subgroups(s, t, &first, &last), DOS_OK) << dos_last_error();
    EXPECT_EQ(first, want[t][0]) << "tensor " << t;
    EXPECT_EQ(last, want[t][1]) << "tensor " << t;
  }
  EXPECT_EQ(dos_tensor_subgroups(s, 3, &first, &last), DOS_OUT_OF_RANGE);
  EXPECT_EQ(dos_stream_sync_supported(s), 0);  // shared memory: the host waits

  // No step yet: nothing to wait for.
  EXPECT_EQ(dos_wait_subgroups(s, 0, 3, nullptr, 0), DOS_OK) << dos_last_error();
  EXPECT_EQ(dos_wait_subgroups(s, 2, 4, nullptr, 0), DOS_INVALID_ARGUMENT);
  EXPECT_THAT(dos_last_error(), ::testing::HasSubstr("4 subgroups"));
  EXPECT_EQ(dos_wait_subgroups(s, 3, 1, nullptr, 0), DOS_INVALID_ARGUMENT);

  dos_hparams h = AdamW(1e-3, 0.01);
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  EXPECT_EQ(dos_step_begin_on_stream(s, &a, nullptr), DOS_FAILED_PRECONDITION);
  EXPECT_THAT(dos_last_error(), ::testing::HasSubstr("dos_step_begin"));
  for (int step = 0; step < 3; ++step) {
    tr.FillGradients();
    ASSERT_EQ(dos_step_begin(s, &a), DOS_OK) << dos_last_error();
    // The range of tensor 1, then everything, while the step may be running.
    ASSERT_EQ(dos_wait_subgroups(s, 2, 3, nullptr, 10000), DOS_OK) << dos_last_error();
    ASSERT_EQ(dos_wait_subgroups(s, 0, 3, nullptr, 10000), DOS_OK) << dos_last_error();
    dos_step_result r;
    ASSERT_EQ(dos_step_wait(s, 10000, &r), DOS_OK) << dos_last_error();
    EXPECT_EQ(r.step, step + 1);
    tr.ExpectStep(1.0, 1.0);
    tr.CheckAgainstDaemon();
  }
}

// dosd dies with a step in flight: the client's watchdog stores the step's
// seq into every progress word (a CUDA stream waiting on them would
// otherwise hang the trainer's GPU for good), waits report UNAVAILABLE and
// the step's result too.
TEST(DaemonCrash, StepInFlightWhenDosdDiesReleasesEveryWaiter) {
  DaemonProcess daemon({"--cpu_threads=1", "--session_lease=0"});
  ASSERT_TRUE(daemon.Start()) << daemon.log();
  FakeTrainer tr(11);
  ASSERT_EQ(tr.Attach(daemon.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_F32, 5000, 0);
  ASSERT_EQ(tr.Register({AdamW(1e-3, 0.0)}, 1000), DOS_OK) << dos_last_error();
  dos_session* s = tr.session();
  // The test's own view of the control block, fetched like the client does.
  auto handle = fdproto::FetchControlBlock(fdproto::SocketPathFor(daemon.socket()),
                                           dos_session_id(s), dos_session_token(s));
  ASSERT_TRUE(handle.ok()) << handle.status();
  auto ctl = ShmSegment::Adopt(std::move(handle->memfd), "control block");
  ASSERT_TRUE(ctl.ok()) << ctl.status();
  auto* block = static_cast<ControlBlock*>((*ctl)->data());

  ASSERT_EQ(::kill(daemon.pid(), SIGSTOP), 0);  // the step will not run
  dos_hparams h = AdamW(1e-3, 0.0);
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  tr.FillGradients();
  ASSERT_EQ(dos_step_begin(s, &a), DOS_OK) << dos_last_error();
  const uint32_t seq = block->request_bell.load();
  EXPECT_NE(block->subgroup_done[0].load(), seq);
  daemon.Kill();
  // Within a few liveness slices the words say "step seq is over".
  for (int i = 0; i < 100 && block->subgroup_done[4].load() != seq; ++i) {
    ::usleep(20'000);
  }
  for (uint32_t i = 0; i < 5; ++i) EXPECT_EQ(block->subgroup_done[i].load(), seq) << i;
  EXPECT_EQ(block->subgroup_done[kMaxTrackedSubgroups - 1].load(), seq);
  EXPECT_EQ(dos_wait_subgroups(s, 0, 4, nullptr, 5000), DOS_UNAVAILABLE);
  EXPECT_THAT(dos_last_error(), ::testing::HasSubstr("abandoned"));
  dos_step_result r;
  EXPECT_EQ(dos_step_wait(s, 5000, &r), DOS_UNAVAILABLE);
}

// dosd stopped (SIGTERM) or was killed before the trainer detached: detach has
// nothing left to do and answers OK at once, without trying the dead socket
// (a process exiting right after must not leave gRPC reconnecting).
TEST(DaemonLifecycle, DetachAfterDosdIsGoneIsOk) {
  for (bool kill : {false, true}) {
    DaemonProcess daemon;
    ASSERT_TRUE(daemon.Start()) << daemon.log();
    dos_attach_options o;
    dos_attach_options_init(&o);
    o.socket_path = daemon.socket().c_str();
    dos_session* s = nullptr;
    ASSERT_EQ(dos_attach(&o, &s), DOS_OK) << dos_last_error();
    if (kill) {
      daemon.Kill();
    } else {
      ASSERT_EQ(daemon.Stop(), 0) << daemon.log();
    }
    const absl::Time start = absl::Now();
    EXPECT_EQ(dos_detach(s), DOS_OK) << (kill ? "killed: " : "stopped: ") << dos_last_error();
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  }
}

TEST_F(DaemonTest, HostMemoryCapAnswersResourceExhausted) {
  DaemonProcess capped({"--host_memory_limit=1M"});
  ASSERT_TRUE(capped.Start()) << capped.log();
  FakeTrainer tr(13);
  ASSERT_EQ(tr.Attach(capped.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_F32, 204800, 0);  // 2.4 MB of state, a whole number of pages
  EXPECT_EQ(tr.Register({AdamW(1e-3, 0)}, 0), DOS_RESOURCE_EXHAUSTED);
  std::string msg = dos_last_error();
  EXPECT_NE(msg.find("2457600 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--host_memory_limit"), std::string::npos) << msg;
  EXPECT_EQ(capped.Stop(), 0);
}

// A trainer that crashed keeps its state for --session_lease; a new one of
// the same user refused for memory is told that state holds it, and how to
// get it back (resume it, or register after the lease).
TEST_F(DaemonTest, AMemoryRefusalNamesTheOrphanedSessionHoldingIt) {
  // The doomed trainer's 65536 parameters hold 768 KiB of state.
  DaemonProcess capped({"--host_memory_limit=1M", "--session_lease=5m", "--cpu_threads=1"});
  ASSERT_TRUE(capped.Start()) << capped.log();
  pid_t child = 0;
  ASSERT_NO_FATAL_FAILURE(RunDoomedTrainer(capped.socket(), &child));
  auto stub = v1::Dos::NewStub(
      grpc::CreateChannel("unix:" + capped.socket(), grpc::InsecureChannelCredentials()));
  std::string state;
  for (int i = 0; i < 500 && state != "orphaned"; ++i) {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse resp;
    ASSERT_TRUE(stub->ListSessions(&ctx, v1::ListSessionsRequest(), &resp).ok());
    state = resp.sessions_size() == 1 ? resp.sessions(0).state() : "";
    if (state != "orphaned") std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(state, "orphaned") << capped.log();

  FakeTrainer tr(14);
  ASSERT_EQ(tr.Attach(capped.socket()), DOS_OK) << dos_last_error();
  tr.AddTensor(DOS_DTYPE_F32, 65536, 0);
  EXPECT_EQ(tr.Register({AdamW(1e-3, 0)}, 0), DOS_RESOURCE_EXHAUSTED);
  const std::string msg = dos_last_error();
  EXPECT_NE(msg.find("--host_memory_limit"), std::string::npos) << msg;
  EXPECT_NE(msg.find("exited without detaching hold session"), std::string::npos) << msg;
  EXPECT_NE(msg.find(absl::StrCat("(pid ", child, ", 768.00 KiB, lease ends in ")),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("resume="), std::string::npos) << msg;
  EXPECT_EQ(capped.Stop(), 0) << capped.log();
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketIsRefused) {
  // A second daemon pointed at the first one's socket must refuse to start.
  pid_t pid = fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, STDOUT_FILENO);
    execl(DOS_DOSD_PATH, DOS_DOSD_PATH, ("--socket=" + daemon_.socket()).c_str(), nullptr);
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  // The first daemon still serves.
  EXPECT_TRUE(SocketAccepts(daemon_.socket()));
}

// --socket naming someone's file (a typo: the flagfile's path) or a file at
// <socket>.fd: dosd refuses to start, naming it, and removes nothing (it
// once deleted the file and served its socket there).
TEST(DaemonLifecycle, AFileThatIsNotASocketIsNeverReplaced) {
  for (const std::string suffix : {"", ".fd"}) {
    DaemonProcess d;
    const std::string path = d.socket() + suffix;
    std::ofstream(path) << "precious";
    EXPECT_FALSE(d.Start()) << d.log();
    EXPECT_NE(d.log().find(path + " is a regular file, not a socket"), std::string::npos)
        << d.log();
    std::ifstream in(path);
    std::string kept;
    in >> kept;
    EXPECT_EQ(kept, "precious") << suffix;
    EXPECT_NE(access((d.socket() + ".lock").c_str(), F_OK), 0) << "lock file left behind";
    std::remove(path.c_str());
  }
}

// SIGHUP (the terminal of a dosd started by hand closed) stops it as
// SIGTERM does: drained, exit 0, nothing left behind (it once died at once).
TEST(DaemonLifecycle, SighupStopsLikeSigterm) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start()) << d.log();
  kill(d.pid(), SIGHUP);
  EXPECT_EQ(d.WaitExit(20000), 0) << d.log();
  EXPECT_NE(d.log().find("signal=SIGHUP"), std::string::npos) << d.log();
  EXPECT_NE(access(d.socket().c_str(), F_OK), 0) << "socket left behind";
  EXPECT_NE(access((d.socket() + ".lock").c_str(), F_OK), 0) << "lock file left behind";
}

TEST(DaemonLifecycle, StaleSocketIsReplacedAndSigtermExitsZero) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start()) << d.log();
  // SIGKILL leaves the socket file behind.
  kill(d.pid(), SIGKILL);
  EXPECT_EQ(d.WaitExit(10000), 128 + SIGKILL);
  ASSERT_EQ(access(d.socket().c_str(), F_OK), 0) << "expected a stale socket file";
  ASSERT_TRUE(d.Start()) << d.log();
  // Health and reflection answer.
  auto channel = grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(d.Stop(), 0) << d.log();
  EXPECT_NE(access(d.socket().c_str(), F_OK), 0) << "socket left behind after a clean stop";
  EXPECT_NE(access((d.socket() + ".lock").c_str(), F_OK), 0)
      << "lock file left behind after a clean stop";
  EXPECT_NE(access((d.socket() + ".fd").c_str(), F_OK), 0)
      << "descriptor socket left behind after a clean stop";
}

}  // namespace
}  // namespace dos::testing
