// GPU path tests (ctest label `gpu`): the fused CUDA kernel against the CPU
// kernel (bitwise) for every dtype pair, and the GPU engine under every
// policy against the CPU path over 50 steps. Skipped, with a message, where
// no CUDA device is visible (CI).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/gpu/finite_scan.h"
#include "daemon/gpu/gpu_engine.h"
#include "daemon/gpu/pcie_copy.h"
#include "daemon/sched/step_executor.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/state/snapshot_pool.h"
#include "tests/support/dtype_print.h"
#include "tests/unit/cpu/adam_test_data.h"

namespace dos::gpu {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define SKIP_WITHOUT_GPU()                                           \
  do {                                                               \
    if (!HaveGpu()) {                                                \
      GTEST_SKIP() << "no CUDA device visible: GPU tests skipped";   \
    }                                                                \
  } while (0)

template <typename T>
T* DeviceCopy(const void* src, size_t bytes) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(d);
}

class KernelTest : public ::testing::TestWithParam<std::tuple<DType, DType, bool>> {};

// "" when a and b are bitwise equal; else how many differ and the first.
std::string Mismatches(const float* a, const float* b, size_t n) {
  size_t count = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, 4) != 0) {
      if (count++ == 0) first = i;
    }
  }
  if (count == 0) return "";
  return absl::StrFormat("%d of %d differ; first at %d: gpu %.9g cpu %.9g", count, n, first,
                         a[first], b[first]);
}

// Where a run's arrays start in one state block: packed as in a subgroup
// (an odd n leaves the moments unaligned: the kernel's element-at-a-time
// path), or each 256-byte aligned (four elements a thread, n % 4 left over).
size_t ArrayOffset(size_t before, bool packed) {
  return packed ? before : (before + 255) / 256 * 256;
}

// With a grad_coef too (protocol 9: the trainer's in-place multiply, which
// the CPU kernel's test pins to fp32 math and bf16 rounding), except for
// fp16 gradients, which are never scaled; and with a grid of 3 blocks (the
// delayed update's cap, --delayed_gpu_kernel_blocks) as with the full one.
TEST_P(KernelTest, BitwiseEqualToCpuKernel) {
  SKIP_WITHOUT_GPU();
  auto [gd, pd, decoupled] = GetParam();
  for (unsigned max_blocks : {0u, 3u})
    for (float coef : {1.0f, 0.3719f})
      for (bool packed : {true, false})
        for (size_t n : {size_t{1}, size_t{7}, size_t{22}, size_t{64}, (size_t{1} << 20) + 3}) {
          if (coef != 1.0f && gd == DType::kF16) continue;
          SCOPED_TRACE(packed ? "packed" : "aligned");
          SCOPED_TRACE(coef);
          SCOPED_TRACE(max_blocks);
          cpu::testing::AdamBuffers host(n, gd, pd, 0, 1234 + n);
          GroupStepParams gp{1e-3, 0.9, 0.999, 1e-8, 0.05};
          cpu::AdamScalars s = cpu::MakeAdamScalars(gp, decoupled, 7, 1024.0, 0.5);
          s.grad_coef = coef;
          // GPU copy of the inputs.
          void* g = DeviceCopy<void>(host.grad.data(), host.grad.size());
          float* st = nullptr;
          const size_t m_at = ArrayOffset(n, packed), v_at = m_at + ArrayOffset(n, packed);
          ASSERT_EQ(cudaMalloc(&st, 4 * (v_at + n)), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(st, host.master.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(st + m_at, host.exp_avg.data(), 4 * n, cudaMemcpyHostToDevice),
                    cudaSuccess);
          ASSERT_EQ(cudaMemcpy(st + v_at, host.exp_avg_sq.data(), 4 * n, cudaMemcpyHostToDevice),
                    cudaSuccess);
          void* out = nullptr;
          ASSERT_EQ(cudaMalloc(&out, n * DTypeSize(pd)), cudaSuccess);
          DeviceAdamSpan dsp{g, gd, st, st + m_at, st + v_at, out, pd, n};
          dsp.max_blocks = max_blocks;
          ASSERT_TRUE(LaunchAdam(s, dsp, nullptr).ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          // CPU scalar kernel on the host copy.
          cpu::AdamSpan csp{host.grad.data(),
                            gd,
                            host.master.data(),
                            host.exp_avg.data(),
                            host.exp_avg_sq.data(),
                            host.out.data(),
                            pd,
                            n};
          cpu::AdamKernel(cpu::Isa::kScalar)(s, csp);
          std::vector<float> gs(3 * n);
          std::vector<char> gout(n * DTypeSize(pd));
          ASSERT_EQ(cudaMemcpy(gs.data(), st, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(gs.data() + n, st + m_at, 4 * n, cudaMemcpyDeviceToHost),
                    cudaSuccess);
          ASSERT_EQ(cudaMemcpy(gs.data() + 2 * n, st + v_at, 4 * n, cudaMemcpyDeviceToHost),
                    cudaSuccess);
          ASSERT_EQ(cudaMemcpy(gout.data(), out, gout.size(), cudaMemcpyDeviceToHost), cudaSuccess);
          EXPECT_EQ(Mismatches(gs.data(), host.master.data(), n), "") << "master n=" << n;
          EXPECT_EQ(Mismatches(gs.data() + n, host.exp_avg.data(), n), "") << "exp_avg n=" << n;
          EXPECT_EQ(Mismatches(gs.data() + 2 * n, host.exp_avg_sq.data(), n), "")
              << "exp_avg_sq n=" << n;
          EXPECT_EQ(std::memcmp(gout.data(), host.out.data(), gout.size()), 0) << "weights n=" << n;
          cudaFree(g);
          cudaFree(st);
          cudaFree(out);
        }
}

// Compact state: bf16 moments, m rounded to nearest even and v stochastically
// from RoundingBits(seed, element_offset + i); the GPU's bf16 moments, master
// and weights must equal the CPU scalar kernel's bit for bit.
TEST_P(KernelTest, CompactStateBitwiseEqualToCpuKernel) {
  SKIP_WITHOUT_GPU();
  auto [gd, pd, decoupled] = GetParam();
  for (bool packed : {true, false})
    for (size_t n : {size_t{1}, size_t{7}, size_t{22}, size_t{64}, (size_t{1} << 20) + 3}) {
      SCOPED_TRACE(packed ? "packed" : "aligned");
      cpu::testing::AdamBuffers host(n, gd, pd, 0, 4321 + n);
      std::vector<uint16_t> m16(n), v16(n);
      for (size_t i = 0; i < n; ++i) {
        m16[i] = FloatToBF16(host.exp_avg[i]);
        v16[i] = FloatToBF16(host.exp_avg_sq[i]);
      }
      GroupStepParams gp{1e-3, 0.9, 0.999, 1e-8, 0.05};
      cpu::AdamScalars s = cpu::MakeAdamScalars(gp, decoupled, 9, 1024.0, 0.5);
      const uint64_t element_offset = 1000003 * n + 17;
      void* g = DeviceCopy<void>(host.grad.data(), host.grad.size());
      // One [master | m16 | v16] block, as a compact subgroup's state.
      char* st = nullptr;
      const size_t m_at = ArrayOffset(4 * n, packed), v_at = m_at + ArrayOffset(2 * n, packed);
      ASSERT_EQ(cudaMalloc(&st, v_at + 2 * n), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(st, host.master.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(st + m_at, m16.data(), 2 * n, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(st + v_at, v16.data(), 2 * n, cudaMemcpyHostToDevice), cudaSuccess);
      void* out = nullptr;
      ASSERT_EQ(cudaMalloc(&out, n * DTypeSize(pd)), cudaSuccess);
      DeviceAdamSpan dsp{.grad = g,
                         .grad_dtype = gd,
                         .master = reinterpret_cast<float*>(st),
                         .exp_avg = nullptr,
                         .exp_avg_sq = nullptr,
                         .param_out = out,
                         .param_dtype = pd,
                         .n = n,
                         .exp_avg_bf16 = reinterpret_cast<uint16_t*>(st + m_at),
                         .exp_avg_sq_bf16 = reinterpret_cast<uint16_t*>(st + v_at),
                         .element_offset = element_offset};
      ASSERT_TRUE(LaunchAdam(s, dsp, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cpu::AdamSpan csp{.grad = host.grad.data(),
                        .grad_dtype = gd,
                        .master = host.master.data(),
                        .exp_avg = nullptr,
                        .exp_avg_sq = nullptr,
                        .param_out = host.out.data(),
                        .param_dtype = pd,
                        .n = n,
                        .exp_avg_bf16 = m16.data(),
                        .exp_avg_sq_bf16 = v16.data(),
                        .element_offset = element_offset};
      cpu::AdamKernel(cpu::Isa::kScalar)(s, csp);
      std::vector<char> gs(8 * n);
      std::vector<char> gout(n * DTypeSize(pd));
      ASSERT_EQ(cudaMemcpy(gs.data(), st, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(gs.data() + 4 * n, st + m_at, 2 * n, cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(gs.data() + 6 * n, st + v_at, 2 * n, cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(gout.data(), out, gout.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(Mismatches(reinterpret_cast<float*>(gs.data()), host.master.data(), n), "")
          << "master n=" << n;
      EXPECT_EQ(std::memcmp(gs.data() + 4 * n, m16.data(), 2 * n), 0) << "exp_avg bf16 n=" << n;
      EXPECT_EQ(std::memcmp(gs.data() + 6 * n, v16.data(), 2 * n), 0) << "exp_avg_sq bf16 n=" << n;
      EXPECT_EQ(std::memcmp(gout.data(), host.out.data(), gout.size()), 0) << "weights n=" << n;
      cudaFree(g);
      cudaFree(st);
      cudaFree(out);
    }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes, KernelTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<KernelTest::ParamType>& info) {
      return "grad_" + std::string(DTypeName(std::get<0>(info.param))) + "_out_" +
             std::string(DTypeName(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "_decoupled" : "_l2");
    });

// The engine under each policy, 50 steps, against the CPU path over the same
// gradients: every path (resident, streamed, CPU in GPU mode) must reproduce
// the CPU kernel bit for bit, since the kernels do.
struct Model {
  std::vector<TensorDesc> tensors;
  std::vector<uint16_t> weights, grads;  // bf16
};

Model MakeModel() {
  Model m;
  const uint64_t sizes[] = {1000, 70001, 33, 250000, 99999};
  uint64_t total = 0;
  for (uint64_t s : sizes) {
    TensorDesc t;
    t.name = absl::StrCat("t", m.tensors.size());
    t.param_dtype = DType::kBF16;
    t.grad_dtype = DType::kBF16;
    t.numel = s;
    m.tensors.push_back(t);
    total += s;
  }
  m.weights.resize(total);
  m.grads.resize(total);
  for (uint64_t i = 0; i < total; ++i) {
    m.weights[i] = FloatToBF16(static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f);
    m.grads[i] = FloatToBF16(static_cast<float>((i * 40503u) % 777) * 1e-4f - 0.03f);
  }
  return m;
}

// `master` gets every tensor's master, exp_avg and exp_avg_sq (fp32 view),
// tensor after tensor.
std::vector<uint16_t> RunSteps(const Model& m, StepExecutor& ex, Engine* gpu,
                               const Policy& policy, std::vector<float>* master,
                               StateFormat format = StateFormat::kFp32,
                               StepOutcome* last = nullptr) {
  HostMemoryBudget budget(0);
  std::vector<GroupConfig> groups(1);
  groups[0].defaults = GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.01};
  auto shard = ShardState::Create(m.tensors, groups, 100000, &budget, "test", {.format = format});
  EXPECT_TRUE(shard.ok());
  const uint64_t total = m.weights.size();
  std::vector<uint16_t> w = m.weights, g = m.grads;
  void* dw = nullptr;
  void* dg = nullptr;
  std::vector<TensorBinding> b;
  if (gpu != nullptr) {
    dw = DeviceCopy<void>(w.data(), 2 * total);
    dg = DeviceCopy<void>(g.data(), 2 * total);
  }
  uint64_t off = 0;
  for (const TensorDesc& t : (*shard)->tensors()) {
    TensorBinding tb;
    tb.param = (gpu ? static_cast<uint16_t*>(dw) : w.data()) + off;
    tb.grad = (gpu ? static_cast<uint16_t*>(dg) : g.data()) + off;
    b.push_back(tb);
    off += t.numel;
  }
  for (uint32_t i = 0; i < b.size(); ++i) EXPECT_TRUE(ex.ReadWeights(**shard, b, i).ok());
  if (gpu) {
    EXPECT_TRUE(gpu->AttachShard(**shard, nullptr).ok());
  }
  StepRequest req{};
  req.num_groups = 1;
  req.grad_scale = 1;
  req.clip_coef = 1;
  req.groups[0] = groups[0].defaults;
  for (int s = 0; s < 50; ++s) {
    auto out = ex.Run(**shard, b, req, policy);
    EXPECT_TRUE(out.ok()) << out.status();
    if (out.ok() && last != nullptr) *last = *out;
  }
  if (gpu) {
    EXPECT_TRUE(gpu->SyncResidentToHost(**shard).ok());
    EXPECT_EQ(cudaMemcpy(w.data(), dw, 2 * total, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(dw);
    cudaFree(dg);
  }
  master->clear();
  for (uint32_t i = 0; i < b.size(); ++i) {
    std::vector<float> part((*shard)->tensors()[i].numel);
    for (int which = 0; which < 3; ++which) {
      (*shard)->ReadTensor(i, which, part.data());
      master->insert(master->end(), part.begin(), part.end());
    }
  }
  return w;
}

// Compact state through every path of the GPU engine (resident copies of
// 8 bytes a parameter, streamed subgroups moving 8 bytes a parameter each
// way, the CPU path in GPU mode): the same bits as the host engine's compact
// state, since the kernels agree bit for bit and the rounding counter is the
// element's flat index whatever the path.
TEST(GpuEngineTest, CompactStateEveryPolicyMatchesCpuPathOver50Steps) {
  SKIP_WITHOUT_GPU();
  Model m = MakeModel();
  cpu::CpuUpdater cpu({.threads = 4});
  cpu::HostEngine host(&cpu);
  StepExecutor cpu_only(&host);
  std::vector<float> ref_state;
  std::vector<uint16_t> ref =
      RunSteps(m, cpu_only, nullptr, Policy{}, &ref_state, StateFormat::kCompact);
  std::vector<float> fp32_state;
  RunSteps(m, cpu_only, nullptr, Policy{}, &fp32_state, StateFormat::kFp32);
  ASSERT_NE(std::memcmp(ref_state.data(), fp32_state.data(), 4 * ref_state.size()), 0)
      << "compact state gave fp32 state's bits: the format was not used";
  GpuEngineOptions opt;
  opt.staging_slots = 2;
  auto engine = GpuEngine::Create(opt, &cpu);
  ASSERT_TRUE(engine.ok()) << engine.status();
  PlannerOptions planner;
  planner.budgets.gpu_resident_bytes = 2 * 100000 * 8;  // two compact subgroups resident
  StepExecutor ex(engine->get(), planner);
  for (const char* text : {"cpu", "static:0.5", "static:1", "interleave:1", "interleave:3",
                           "auto"}) {
    Policy p = *ParsePolicy(text);
    std::vector<float> state;
    StepOutcome last;
    std::vector<uint16_t> w =
        RunSteps(m, ex, engine->get(), p, &state, StateFormat::kCompact, &last);
    EXPECT_EQ(w, ref) << text;
    if (std::string(text) == "interleave:1") {  // every subgroup streamed: 8 B/param each way
      EXPECT_EQ(last.h2d_bytes, 8 * m.weights.size());
      EXPECT_EQ(last.d2h_bytes, 8 * m.weights.size());
    }
    ASSERT_EQ(state.size(), ref_state.size());
    EXPECT_EQ(std::memcmp(state.data(), ref_state.data(), 4 * state.size()), 0) << text;
  }
}

// The CPU path's copy kernel: every alignment of both ends and the size
// (each picks another access width), both directions, bytes outside the
// range untouched.
TEST(PcieCopyTest, CopiesEveryAlignmentBothWays) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kCap = (1 << 20) + 64;
  char* host = nullptr;
  char* dev = nullptr;
  ASSERT_EQ(cudaHostAlloc(&host, kCap, cudaHostAllocDefault), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev, kCap), cudaSuccess);
  std::vector<char> src(kCap), back(kCap);
  for (size_t i = 0; i < kCap; ++i) src[i] = static_cast<char>(i * 131 + 7);
  for (size_t size : {size_t{0}, size_t{1}, size_t{3}, size_t{16}, size_t{1000}, size_t{1} << 20}) {
    for (size_t doff : {0, 1, 2, 4, 8, 16}) {
      for (size_t soff : {0, 2, 16}) {
        SCOPED_TRACE(absl::StrCat("size ", size, " device offset ", doff, " host offset ", soff));
        // host -> device (the weights' direction)
        std::memcpy(host, src.data(), kCap);
        ASSERT_EQ(cudaMemset(dev, 0x5a, kCap), cudaSuccess);
        ASSERT_TRUE(LaunchPcieCopy(dev + doff, host + soff, size, nullptr).ok());
        ASSERT_EQ(cudaMemcpy(back.data(), dev, kCap, cudaMemcpyDeviceToHost), cudaSuccess);
        for (size_t i = 0; i < kCap; ++i) {
          const char want = i >= doff && i < doff + size ? src[soff + i - doff] : 0x5a;
          ASSERT_EQ(back[i], want) << "H2D at " << i;
        }
        // device -> host (the gradients' direction)
        ASSERT_EQ(cudaMemcpy(dev, src.data(), kCap, cudaMemcpyHostToDevice), cudaSuccess);
        std::memset(host, 0x3c, kCap);
        ASSERT_TRUE(LaunchPcieCopy(host + soff, dev + doff, size, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (size_t i = 0; i < kCap; ++i) {
          const char want = i >= soff && i < soff + size ? src[doff + i - soff] : 0x3c;
          ASSERT_EQ(host[i], want) << "D2H at " << i;
        }
      }
    }
  }
  cudaFreeHost(host);
  cudaFree(dev);
}

TEST(GpuEngineTest, EveryPolicyMatchesCpuPathOver50Steps) {
  SKIP_WITHOUT_GPU();
  Model m = MakeModel();
  cpu::CpuUpdater cpu({.threads = 4});
  cpu::HostEngine host(&cpu);
  StepExecutor cpu_only(&host);
  std::vector<float> ref_master;
  std::vector<uint16_t> ref = RunSteps(m, cpu_only, nullptr, Policy{}, &ref_master);
  for (int mode = 0; mode < 4; ++mode) {
    const bool fp32_grads = mode & 1;
    const bool copy_kernel = mode < 2;  // the CPU path's copies by kernel or by DMA
    GpuEngineOptions opt;
    opt.staging_slots = 2;
    opt.cpu_grad_fp32 = fp32_grads;
    opt.cpu_copy_kernel = copy_kernel;
    auto engine = GpuEngine::Create(opt, &cpu);
    ASSERT_TRUE(engine.ok()) << engine.status();
    PlannerOptions planner;
    planner.budgets.gpu_resident_bytes = 2 * 100000 * 12;  // auto keeps two subgroups resident
    planner.grad_fp32 = fp32_grads;
    StepExecutor ex(engine->get(), planner);
    for (const char* text : {"cpu", "static:0.5", "interleave:1", "interleave:2", "interleave:3",
                             "auto"}) {
      Policy p = *ParsePolicy(text);
      std::vector<float> master;
      std::vector<uint16_t> w = RunSteps(m, ex, engine->get(), p, &master);
      EXPECT_EQ(w, ref) << text << " fp32_grads=" << fp32_grads << " kernel=" << copy_kernel;
      EXPECT_EQ(std::memcmp(master.data(), ref_master.data(), 4 * master.size()), 0)
          << text << " fp32_grads=" << fp32_grads << " kernel=" << copy_kernel;
    }
  }
}

// One tensor of `numel` bf16 weights and gradients.
TensorDesc Bf16Tensor(uint64_t numel) {
  TensorDesc t;
  t.param_dtype = DType::kBF16;
  t.grad_dtype = DType::kBF16;
  t.numel = numel;
  return t;
}

TEST(GpuEngineTest, NonFiniteGradientSkipsStep) {
  SKIP_WITHOUT_GPU();
  cpu::CpuUpdater cpu({.threads = 2});
  auto engine = GpuEngine::Create({}, &cpu);
  ASSERT_TRUE(engine.ok());
  HostMemoryBudget budget(0);
  std::vector<GroupConfig> groups(1);
  auto shard = ShardState::Create({Bf16Tensor(1000)}, groups, 512, &budget, "test");
  ASSERT_TRUE(shard.ok());
  std::vector<uint16_t> g(1000, FloatToBF16(0.1f));
  g[777] = 0x7f80;  // +inf
  void* dg = DeviceCopy<void>(g.data(), 2000);
  void* dw = DeviceCopy<void>(g.data(), 2000);
  TensorBinding b;
  b.param = dw;
  b.grad = dg;
  auto finite = (*engine)->AllFinite(**shard, {&b, 1});
  ASSERT_TRUE(finite.ok());
  EXPECT_FALSE(*finite);
  cudaFree(dg);
  cudaFree(dw);
}

// A step that waits for a checkpoint's writer (the staging pool spent) waits
// without holding the GPU engine: another session's step on the same GPU
// goes on meanwhile, and both end with the exact steps' state.
TEST(GpuEngineTest, AStepWaitingForACheckpointHoldsUpNoOtherSession) {
  SKIP_WITHOUT_GPU();
  cpu::CpuUpdater cpu({.threads = 2});
  auto engine = GpuEngine::Create({}, &cpu);
  ASSERT_TRUE(engine.ok()) << engine.status();
  HostMemoryBudget budget(0);
  std::vector<GroupConfig> groups(1);
  const TensorDesc t = Bf16Tensor(4096);
  struct Session {
    std::unique_ptr<ShardState> shard;
    void* dw = nullptr;
    void* dg = nullptr;
    std::vector<TensorBinding> b{1};
  };
  std::vector<uint16_t> w(t.numel, FloatToBF16(0.5f)), g(t.numel, FloatToBF16(0.01f));
  Session a, b;
  for (Session* s : {&a, &b}) {
    auto shard = ShardState::Create({t}, groups, 1024, &budget, "test");
    ASSERT_TRUE(shard.ok());
    s->shard = std::move(*shard);
    s->dw = DeviceCopy<void>(w.data(), 2 * t.numel);
    s->dg = DeviceCopy<void>(g.data(), 2 * t.numel);
    s->b[0] = {s->dw, s->dg};
    ASSERT_TRUE((*engine)->AttachShard(*s->shard, nullptr).ok());
  }
  StepExecutor ex_a(engine->get()), ex_b(engine->get());
  ASSERT_TRUE(ex_a.ReadWeights(*a.shard, a.b, 0).ok());
  ASSERT_TRUE(ex_b.ReadWeights(*b.shard, b.b, 0).ok());
  StepRequest req{};
  req.num_groups = 1;
  req.grad_scale = 1;
  req.clip_coef = 1;
  req.groups[0] = GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.01};
  const Policy cpu_path = *ParsePolicy("cpu");
  SnapshotPool none(0, nullptr, [](uint64_t) { return true; });  // every write waits
  a.shard->BeginSnapshot(&none);
  std::atomic<bool> a_done{false};
  std::thread step_a([&] {
    EXPECT_TRUE(ex_a.Run(*a.shard, a.b, req, cpu_path).ok());
    a_done = true;
  });
  auto step_b =
      std::async(std::launch::async, [&] { return ex_b.Run(*b.shard, b.b, req, cpu_path); });
  const bool b_went_on = step_b.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(b_went_on) << "session B's step waited for session A's checkpoint";
  EXPECT_FALSE(a_done) << "A's step did not wait for its checkpoint's writer";
  for (uint32_t i = 0; i < a.shard->subgroups().size(); ++i) {
    (void)a.shard->SnapshotAcquire(i);
    a.shard->SnapshotReleaseBelow(i + 1);
  }
  a.shard->EndSnapshot();
  step_a.join();
  ASSERT_TRUE(step_b.get().ok());
  std::vector<float> ma(t.numel), mb(t.numel);
  a.shard->ReadTensor(0, 0, ma.data());
  b.shard->ReadTensor(0, 0, mb.data());
  EXPECT_EQ(ma, mb);
  EXPECT_NE(ma[0], 0.5f);
  for (Session* s : {&a, &b}) {
    cudaFree(s->dw);
    cudaFree(s->dg);
  }
}

// The scan's bit patterns per dtype: inf of both signs, a quiet NaN and a
// NaN whose payload is 1; the largest finite value of each sign must pass.
struct ScanBits {
  DType dtype;
  size_t elem;
  std::vector<uint32_t> bad;
  std::vector<uint32_t> finite;
};

std::vector<ScanBits> AllScanBits() {
  return {{DType::kF32,
           4,
           {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u},
           {0x7f7fffffu, 0xff7fffffu, 0x3f800000u, 0x00000001u}},
          {DType::kBF16, 2, {0x7f80u, 0xff80u, 0x7fc0u, 0x7f81u}, {0x7f7fu, 0xff7fu, 0x3f80u, 1u}},
          {DType::kF16, 2, {0x7c00u, 0xfc00u, 0x7e00u, 0x7c01u}, {0x7bffu, 0xfbffu, 0x3c00u, 1u}}};
}

void PutBits(std::vector<uint8_t>& buf, size_t byte, size_t elem, uint32_t bits) {
  std::memcpy(buf.data() + byte, &bits, elem);  // little endian: the low bytes
}

// Scans `tensors` (pointers into dev) and returns whether the flag was set.
bool ScanFlags(const std::vector<ScanTensor>& tensors) {
  int* flag = nullptr;
  EXPECT_EQ(cudaMalloc(&flag, sizeof(int)), cudaSuccess);
  EXPECT_EQ(cudaMemset(flag, 0, sizeof(int)), cudaSuccess);
  EXPECT_TRUE(LaunchNonFiniteScan(tensors.data(), tensors.size(), flag, nullptr).ok());
  int host = -1;
  EXPECT_EQ(cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(flag);
  return host != 0;
}

TEST(FiniteScanTest, FindsEachNonFiniteValueAtEveryAlignmentAndLength) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kMax = 300001;
  std::mt19937 rng(7);
  for (const ScanBits& b : AllScanBits()) {
    std::vector<uint8_t> host((kMax + 16) * b.elem);
    for (size_t i = 0; i + b.elem <= host.size(); i += b.elem) {
      PutBits(host, i, b.elem, b.finite[rng() % b.finite.size()]);
    }
    auto* dev = DeviceCopy<uint8_t>(host.data(), host.size());
    for (size_t offset = 0; offset < 16 / b.elem; ++offset) {
      for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{8}, size_t{9}, size_t{65},
                       size_t{1000}, kMax}) {
        const std::vector<ScanTensor> one = {{dev + offset * b.elem, b.dtype, n}};
        EXPECT_FALSE(ScanFlags(one)) << DTypeName(b.dtype) << " offset " << offset << " n " << n;
        for (size_t pos : {size_t{0}, n / 2, n - 1}) {
          const uint32_t bad = b.bad[(offset + pos) % b.bad.size()];
          const size_t byte = (offset + pos) * b.elem;
          uint32_t keep = 0;
          std::memcpy(&keep, host.data() + byte, b.elem);
          ASSERT_EQ(cudaMemcpy(dev + byte, &bad, b.elem, cudaMemcpyHostToDevice), cudaSuccess);
          EXPECT_TRUE(ScanFlags(one)) << DTypeName(b.dtype) << " offset " << offset << " n " << n
                                      << " bad 0x" << std::hex << bad << " at " << std::dec << pos;
          ASSERT_EQ(cudaMemcpy(dev + byte, &keep, b.elem, cudaMemcpyHostToDevice), cudaSuccess);
        }
      }
    }
    cudaFree(dev);
  }
}

TEST(FiniteScanTest, ManyTensorsOfMixedDtypesAreAllScannedInOneCall) {
  SKIP_WITHOUT_GPU();
  // 300 tensors (more than one launch's batch), the first large, the rest
  // small, at odd offsets: a bad element in any one of them sets the flag.
  const std::vector<ScanBits> bits = AllScanBits();
  struct Placed {
    size_t byte;
    size_t n;
    const ScanBits* b;
  };
  std::vector<Placed> placed;
  size_t bytes = 0;
  for (size_t k = 0; k < 300; ++k) {
    const ScanBits* b = &bits[k % bits.size()];
    const size_t n = k == 0 ? (size_t{1} << 22) + 3 : 1 + (k * 37) % 5000;
    bytes = (bytes + 15) / 16 * 16 + (k % 8) * 2 * b->elem % 16;
    bytes = (bytes + b->elem - 1) / b->elem * b->elem;
    placed.push_back({bytes, n, b});
    bytes += n * b->elem;
  }
  std::vector<uint8_t> host(bytes + 16);
  for (const Placed& p : placed) {
    for (size_t i = 0; i < p.n; ++i)
      PutBits(host, p.byte + i * p.b->elem, p.b->elem, p.b->finite[i % 4]);
  }
  auto* dev = DeviceCopy<uint8_t>(host.data(), host.size());
  std::vector<ScanTensor> tensors;
  for (const Placed& p : placed) tensors.push_back({dev + p.byte, p.b->dtype, p.n});
  EXPECT_FALSE(ScanFlags(tensors));
  for (size_t k : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{299}}) {
    const Placed& p = placed[k];
    for (size_t pos : {size_t{0}, p.n - 1}) {
      const size_t byte = p.byte + pos * p.b->elem;
      const uint32_t bad = p.b->bad[k % 4];
      ASSERT_EQ(cudaMemcpy(dev + byte, &bad, p.b->elem, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_TRUE(ScanFlags(tensors)) << "tensor " << k << " element " << pos;
      ASSERT_EQ(cudaMemcpy(dev + byte, host.data() + byte, p.b->elem, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  EXPECT_FALSE(ScanFlags(tensors));
  cudaFree(dev);
}

}  // namespace
}  // namespace dos::gpu
