// Compact state (8 bytes a parameter) in the planner and on the host path:
// the layout carries the shard's state bytes into the model (PCIe, host
// memory and CPU rates) and the resident budget, and a host step over a
// compact shard is the CPU kernel's compact update element for element, its
// stochastic rounding counted by the flat element index.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "daemon/cpu/host_engine.h"
#include "daemon/sched/step_executor.h"
#include "daemon/sched/step_planner.h"

namespace dos {
namespace {

constexpr uint64_t kSg = 1 << 20;

PlannerOptions Gpu(uint64_t resident_bytes) {
  PlannerOptions o;
  o.budgets.gpu = true;
  o.budgets.gpu_resident_bytes = resident_bytes;
  o.initial.cpu_params_per_s = 3.7e9;
  o.initial.gpu_params_per_s = 120e9;
  o.initial.h2d_bytes_per_s = 55e9;
  o.initial.d2h_bytes_per_s = 55e9;
  o.initial.pcie_both_bytes_per_s = 97e9;
  o.initial.host_bytes_per_s = 145e9;
  return o;
}

ShardLayout Uniform(uint32_t n, double state_bytes) {
  ShardLayout l;
  l.subgroup_numel.assign(n, kSg);
  l.state_bytes = state_bytes;
  return l;
}

TEST(CompactPlanTest, LayoutOfACompactShardHasEightStateBytes) {
  HostMemoryBudget budget(0);
  std::vector<TensorDesc> tensors(1);
  tensors[0].numel = 300;
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kCompact}) {
    auto shard = ShardState::Create(tensors, {GroupConfig{}}, 100, &budget, "t", {.format = f});
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(ShardLayout::Of(**shard, false).state_bytes, f == StateFormat::kCompact ? 8 : 12);
  }
}

TEST(CompactPlanTest, TheResidentBudgetHoldsHalfAgainAsManyCompactSubgroups) {
  const uint64_t budget = 6 * kSg * 8;  // 6 compact subgroups, 4 fp32 ones
  StepPlanner planner(Gpu(budget));
  EXPECT_EQ(planner.Plan(*ParsePolicy("auto"), Uniform(10, 12)).resident, 4u);
  EXPECT_EQ(planner.Plan(*ParsePolicy("auto"), Uniform(10, 8)).resident, 6u);
}

TEST(CompactPlanTest, TheModelSeesTheSessionsStateBytesAndPredictsAFasterStep) {
  StepPlanner planner(Gpu(0));
  StepPlan fp32 = planner.Plan(*ParsePolicy("auto"), Uniform(16, 12));
  StepPlan compact = planner.Plan(*ParsePolicy("auto"), Uniform(16, 8));
  EXPECT_EQ(fp32.inputs.state_bytes, 12);
  EXPECT_EQ(compact.inputs.state_bytes, 8);
  EXPECT_EQ(planner.model_inputs().state_bytes, 8);
  const double r32 = PerfModel::Bound(fp32.inputs, fp32.gpu_share).params_per_s;
  const double r8 = PerfModel::Bound(compact.inputs, compact.gpu_share).params_per_s;
  EXPECT_GT(r8, 1.3 * r32) << "compact moves 2/3 of the state bytes";
  EXPECT_LT(compact.predicted_us, fp32.predicted_us);
  // The CPU path's starting rate is the compact kernel's (28/20 the fp32 one).
  StepPlan cpu32 = planner.Plan(*ParsePolicy("cpu"), Uniform(4, 12));
  StepPlan cpu8 = planner.Plan(*ParsePolicy("cpu"), Uniform(4, 8));
  EXPECT_NEAR(cpu8.cpu_path_rate / cpu32.cpu_path_rate, 28.0 / 20.0, 1e-9);
}

TEST(CompactPlanTest, AHostStepOnCompactStateIsTheKernelsCompactUpdate) {
  HostMemoryBudget budget(0);
  cpu::CpuUpdater cpu(cpu::CpuUpdaterOptions{.threads = 2, .tile_elems = 96});
  cpu::HostEngine engine(&cpu);
  std::vector<TensorDesc> tensors(2);
  tensors[0].numel = 3001;  // subgroups of 1000 cross the tensor boundary
  tensors[1].numel = 1500;
  auto shard = *ShardState::Create(tensors, {GroupConfig{}}, 1000, &budget, "t",
                                   {.format = StateFormat::kCompact});
  const uint64_t total = 4501;
  std::vector<float> params(total), grads(total);
  for (uint64_t i = 0; i < total; ++i) {
    params[i] = 0.5f + 1e-3f * static_cast<float>(i % 97);
    grads[i] = 1e-2f * static_cast<float>(static_cast<int>(i % 13) - 6);
  }
  std::vector<TensorBinding> b = {{params.data(), grads.data()},
                                  {params.data() + 3001, grads.data() + 3001}};
  StepExecutor ex(&engine);
  for (uint32_t t = 0; t < 2; ++t) ASSERT_TRUE(ex.ReadWeights(*shard, b, t).ok());
  // The expected state: the scalar kernel over the flat space, compact
  // moments, rounding counter = flat index.
  std::vector<float> p(params);
  std::vector<uint16_t> m(total, 0), v(total, 0);
  StepRequest req{};
  req.num_groups = 1;
  req.grad_scale = 1;
  req.clip_coef = 1;
  req.groups[0] = GroupStepParams{1e-2, 0.9, 0.999, 1e-8, 0.01};
  for (int step = 1; step <= 5; ++step) {
    absl::StatusOr<StepOutcome> out = ex.Run(*shard, b, req, Policy{});
    ASSERT_TRUE(out.ok()) << out.status();
    const cpu::AdamScalars s = cpu::MakeAdamScalars(req.groups[0], true, step, 1, 1);
    cpu::AdamSpan span{.grad = grads.data(), .grad_dtype = DType::kF32, .master = p.data(),
                       .exp_avg = nullptr, .exp_avg_sq = nullptr, .param_out = nullptr,
                       .param_dtype = DType::kF32, .n = total, .exp_avg_bf16 = m.data(),
                       .exp_avg_sq_bf16 = v.data(), .element_offset = 0};
    cpu::AdamKernel(cpu::Isa::kScalar)(s, span);
  }
  for (uint32_t t = 0; t < 2; ++t) {
    const uint64_t n = shard->tensors()[t].numel, off = t == 0 ? 0 : 3001;
    std::vector<float> got(n);
    shard->ReadTensor(t, 0, got.data());
    ASSERT_EQ(std::memcmp(got.data(), p.data() + off, 4 * n), 0) << "master of tensor " << t;
    shard->ReadTensor(t, 1, got.data());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], BF16ToFloat(m[off + i])) << t << " " << i;
    shard->ReadTensor(t, 2, got.data());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], BF16ToFloat(v[off + i])) << t << " " << i;
    ASSERT_EQ(std::memcmp(params.data() + off, p.data() + off, 4 * n), 0) << "trainer weights";
  }
}

}  // namespace
}  // namespace dos
