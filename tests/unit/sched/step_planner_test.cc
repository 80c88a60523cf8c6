// StepPlanner: every policy's placement, the budgets (GPU memory, PCIe, host
// memory), layouts, degenerate shards, learning from measurements and the
// timeline, all without a GPU.
#include "daemon/sched/step_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "daemon/sched/step_timeline.h"
#include "daemon/state/shard_state.h"
#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

constexpr uint64_t kSg = 100'000'000;  // 100M-parameter subgroups, as the benchmark's

using testing::GpuPlannerOptions;

PerfInputs H200() { return testing::H200Rates(); }
ShardLayout Uniform(uint32_t n, uint64_t numel = kSg) { return testing::UniformLayout(n, numel); }
PlannerOptions Gpu(uint64_t resident_bytes = 0) { return GpuPlannerOptions(resident_bytes); }

Policy P(absl::string_view text) { return *ParsePolicy(text); }

std::vector<uint32_t> Range(uint32_t begin, uint32_t end) {
  std::vector<uint32_t> v(end - begin);
  std::iota(v.begin(), v.end(), begin);
  return v;
}

// Every subgroup is in exactly one place: resident, or one of the lists.
void ExpectPartition(const StepPlan& plan) {
  std::multiset<uint32_t> seen;
  for (uint32_t i = 0; i < plan.resident; ++i) seen.insert(i);
  for (const auto* v : {&plan.gpu_only, &plan.cpu_only, &plan.shared}) seen.insert(v->begin(), v->end());
  ASSERT_EQ(seen.size(), plan.num_subgroups);
  for (uint32_t i = 0; i < plan.num_subgroups; ++i) EXPECT_EQ(seen.count(i), 1u) << i;
  uint64_t total = 0;
  for (uint64_t n : plan.numel) total += n;
  EXPECT_EQ(plan.resident_params + plan.streamed_params, total);
}

// --- cpu -------------------------------------------------------------------

TEST(StepPlannerTest, CpuPutsEverySubgroupOnTheCpuInOrder) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("cpu"), Uniform(5));
  EXPECT_EQ(plan.resident, 0u);
  EXPECT_EQ(plan.cpu_only, Range(0, 5));
  EXPECT_TRUE(plan.gpu_only.empty());
  EXPECT_TRUE(plan.shared.empty());
  EXPECT_EQ(plan.gpu_share, 0);
  EXPECT_EQ(plan.binding, "cpu");
  ExpectPartition(plan);
}

TEST(StepPlannerTest, CpuPredictsTheCpuKernelTimePlusTransfers) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("cpu"), Uniform(20));
  const double expect =
      PerfModel::PhaseSeconds(plan.inputs, 0, 20.0 * kSg, 0, kSg) * 1e6;
  EXPECT_DOUBLE_EQ(plan.predicted_us, expect);
  EXPECT_NEAR(plan.predicted_us, 20.0 * kSg / 3.7e9 * 1e6, 0.02 * plan.predicted_us);
}

// --- static ------------------------------------------------------------------

TEST(StepPlannerTest, StaticHalfKeepsTheFrontHalfResidentAndTheRestOnTheCpu) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("static:0.5"), Uniform(10));
  EXPECT_EQ(plan.resident, 5u);
  EXPECT_EQ(plan.cpu_only, Range(5, 10));
  EXPECT_TRUE(plan.gpu_only.empty());
  EXPECT_EQ(plan.resident_params, 5 * kSg);
  EXPECT_EQ(plan.streamed_params, 5 * kSg);
  EXPECT_EQ(plan.gpu_share, 0);  // of the streamed parameters: none go to the GPU
  ExpectPartition(plan);
}

TEST(StepPlannerTest, StaticRoundsTheResidentCountToNearest) {
  StepPlanner planner(Gpu());
  EXPECT_EQ(planner.Plan(P("static:0.25"), Uniform(10)).resident, 3u);  // 2.5 -> 3
  EXPECT_EQ(planner.Plan(P("static:0.24"), Uniform(10)).resident, 2u);
  EXPECT_EQ(planner.Plan(P("static:0.5"), Uniform(1)).resident, 1u);    // 0.5 -> 1
}

TEST(StepPlannerTest, StaticZeroIsAllCpu) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("static:0"), Uniform(4));
  EXPECT_EQ(plan.resident, 0u);
  EXPECT_EQ(plan.cpu_only, Range(0, 4));
}

TEST(StepPlannerTest, StaticOneIsAllResidentAndPredictsGpuKernelTimeOnly) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("static:1"), Uniform(4));
  EXPECT_EQ(plan.resident, 4u);
  EXPECT_TRUE(plan.cpu_only.empty());
  EXPECT_EQ(plan.streamed_params, 0u);
  EXPECT_DOUBLE_EQ(plan.predicted_us, 4.0 * kSg / 120e9 * 1e6);
  ExpectPartition(plan);
}

TEST(StepPlannerTest, StaticIgnoresTheGpuMemoryBudget) {
  // static asks for GPU memory permanently; the budget is auto's.
  StepPlanner planner(Gpu(/*resident_bytes=*/kSg * 12));
  EXPECT_EQ(planner.Plan(P("static:0.75"), Uniform(4)).resident, 3u);
}

// --- interleave --------------------------------------------------------------

TEST(StepPlannerTest, InterleaveOneStreamsEverySubgroup) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("interleave:1"), Uniform(6));
  EXPECT_EQ(plan.gpu_only, Range(0, 6));
  EXPECT_TRUE(plan.cpu_only.empty());
  EXPECT_EQ(plan.gpu_share, 1.0);
  EXPECT_EQ(plan.binding, "pcie_both");
}

TEST(StepPlannerTest, InterleaveTwoAlternates) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("interleave:2"), Uniform(7));
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{0, 2, 4, 6}));
  EXPECT_EQ(plan.cpu_only, (std::vector<uint32_t>{1, 3, 5}));
  EXPECT_DOUBLE_EQ(plan.gpu_share, 4.0 / 7.0);
  ExpectPartition(plan);
}

TEST(StepPlannerTest, InterleaveThreeSendsEveryThirdSubgroup) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("interleave:3"), Uniform(9));
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{0, 3, 6}));
  EXPECT_EQ(plan.cpu_only.size(), 6u);
  EXPECT_DOUBLE_EQ(plan.gpu_share, 1.0 / 3.0);
}

TEST(StepPlannerTest, InterleaveStrideBeyondTheShardStreamsOnlyTheFirst) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("interleave:50"), Uniform(4));
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{0}));
  EXPECT_EQ(plan.cpu_only, Range(1, 4));
}

TEST(StepPlannerTest, InterleaveShareIsByParametersNotSubgroups) {
  StepPlanner planner(Gpu());
  ShardLayout l;
  l.subgroup_numel = {300, 100, 300, 100};
  StepPlan plan = planner.Plan(P("interleave:2"), l);
  EXPECT_DOUBLE_EQ(plan.gpu_share, 600.0 / 800.0);
}

// --- auto --------------------------------------------------------------------

TEST(StepPlannerTest, AutoTakesTheModelsShareAndPinsHalfOfEachSide) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  const PerfPrediction best = PerfModel::Solve(plan.inputs);
  EXPECT_DOUBLE_EQ(plan.gpu_share, best.gpu_share);
  EXPECT_EQ(plan.binding, best.binding);
  EXPECT_EQ(plan.resident, 0u);
  // x is about 0.66: half of it (6.6 subgroups) rounds down to 6 pinned to
  // the GPU from the front, half of 1 - x (3.4) to 3 pinned to the CPU from
  // the back (the far end first), the middle 11 shared.
  EXPECT_EQ(plan.gpu_only, Range(0, 6));
  EXPECT_EQ(plan.cpu_only, (std::vector<uint32_t>{19, 18, 17}));
  EXPECT_EQ(plan.shared, Range(6, 17));
  ExpectPartition(plan);
}

TEST(StepPlannerTest, AutoWithTwoOrFewerSubgroupsSharesThemAll) {
  StepPlanner planner(Gpu());
  StepPlan two = planner.Plan(P("auto"), Uniform(2));
  EXPECT_EQ(two.shared, Range(0, 2));
  EXPECT_TRUE(two.gpu_only.empty());
  EXPECT_TRUE(two.cpu_only.empty());
  StepPlan one = planner.Plan(P("auto"), Uniform(1));
  EXPECT_EQ(one.shared, Range(0, 1));
  ExpectPartition(one);
}

TEST(StepPlannerTest, AutoKeepsAsManySubgroupsResidentAsTheBudgetHolds) {
  StepPlanner planner(Gpu(/*resident_bytes=*/2 * kSg * 12 + 5));
  StepPlan plan = planner.Plan(P("auto"), Uniform(10));
  EXPECT_EQ(plan.resident, 2u);
  EXPECT_EQ(plan.resident_params, 2 * kSg);
  EXPECT_EQ(plan.streamed_params, 8 * kSg);
  ExpectPartition(plan);
  for (uint32_t i : plan.gpu_only) EXPECT_GE(i, 2u);
}

TEST(StepPlannerTest, AutoBudgetBeyondTheShardMakesEverySubgroupResident) {
  StepPlanner planner(Gpu(/*resident_bytes=*/uint64_t{1} << 50));
  StepPlan plan = planner.Plan(P("auto"), Uniform(3));
  EXPECT_EQ(plan.resident, 3u);
  EXPECT_TRUE(plan.shared.empty() && plan.gpu_only.empty() && plan.cpu_only.empty());
  EXPECT_DOUBLE_EQ(plan.predicted_us, 3.0 * kSg / 120e9 * 1e6);
}

TEST(StepPlannerTest, AutoSubgroupLargerThanTheBudgetIsNotResident) {
  StepPlanner planner(Gpu(/*resident_bytes=*/kSg * 12 - 1));
  EXPECT_EQ(planner.Plan(P("auto"), Uniform(4)).resident, 0u);
}

TEST(StepPlannerTest, AutoBudgetChargesEveryResidentSubgroupTheLargestOnesState) {
  ShardLayout l;
  l.subgroup_numel = {100, 1000, 100, 100};
  StepPlanner planner(Gpu(/*resident_bytes=*/2 * 1000 * 12));
  EXPECT_EQ(planner.Plan(P("auto"), l).resident, 2u);
}

TEST(StepPlannerTest, AutoWithAZeroBudgetKeepsNothingResident) {
  StepPlanner planner(Gpu(/*resident_bytes=*/0));
  EXPECT_EQ(planner.Plan(P("auto"), Uniform(8)).resident, 0u);
}

TEST(StepPlannerTest, AutoPinsByParametersWithUnevenSubgroups) {
  StepPlanner planner(Gpu());
  ShardLayout l;
  // A shard's last subgroup is usually short.
  l.subgroup_numel = {kSg, kSg, kSg, kSg, kSg, kSg, kSg, kSg / 10};
  StepPlan plan = planner.Plan(P("auto"), l);
  ExpectPartition(plan);
  double gpu_pinned = 0, cpu_pinned = 0;
  for (uint32_t i : plan.gpu_only) gpu_pinned += static_cast<double>(l.subgroup_numel[i]);
  for (uint32_t i : plan.cpu_only) cpu_pinned += static_cast<double>(l.subgroup_numel[i]);
  const double total = static_cast<double>(plan.streamed_params);
  EXPECT_LE(gpu_pinned, 0.5 * plan.gpu_share * total);
  EXPECT_LE(cpu_pinned, 0.5 * (1 - plan.gpu_share) * total);
  EXPECT_EQ(plan.cpu_only.front(), 7u);  // the CPU starts at the far end
}

TEST(StepPlannerTest, AutoPredictionIsTheModelsPhaseTime) {
  StepPlanner planner(Gpu(/*resident_bytes=*/kSg * 12));
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  EXPECT_DOUBLE_EQ(plan.predicted_us,
                   PerfModel::PhaseSeconds(plan.inputs, plan.gpu_share, 19.0 * kSg, 1.0 * kSg,
                                           kSg) * 1e6);
}

// --- without a GPU -------------------------------------------------------------

class NoGpuTest : public ::testing::TestWithParam<const char*> {};

TEST_P(NoGpuTest, EveryPolicyRunsAsCpu) {
  PlannerOptions o;  // budgets.gpu = false
  o.budgets.gpu_resident_bytes = uint64_t{1} << 40;
  StepPlanner planner(o);
  StepPlan plan = planner.Plan(P(GetParam()), Uniform(6));
  EXPECT_EQ(plan.policy, P(GetParam()));  // the session still reports its policy
  EXPECT_EQ(plan.resident, 0u);
  EXPECT_EQ(plan.cpu_only, Range(0, 6));
  EXPECT_TRUE(plan.gpu_only.empty() && plan.shared.empty());
  EXPECT_EQ(plan.gpu_share, 0);
}

// "static:0.5" -> static_0_5 (test names take letters, digits and _ only).
std::string PolicyName(const ::testing::TestParamInfo<const char*>& info) {
  std::string s = info.param;
  for (char& c : s) {
    if (c == ':' || c == '.') c = '_';
  }
  return s;
}

INSTANTIATE_TEST_SUITE_P(Policies, NoGpuTest,
                         ::testing::Values("cpu", "static:0.5", "interleave:2", "auto"),
                         PolicyName);

// --- degenerate shards -----------------------------------------------------------

class EmptyShardTest : public ::testing::TestWithParam<const char*> {};

TEST_P(EmptyShardTest, PlansNothingAndPredictsZero) {
  StepPlanner planner(Gpu(/*resident_bytes=*/kSg * 12));
  StepPlan plan = planner.Plan(P(GetParam()), ShardLayout{});
  EXPECT_EQ(plan.num_subgroups, 0u);
  EXPECT_EQ(plan.resident, 0u);
  EXPECT_TRUE(plan.gpu_only.empty() && plan.cpu_only.empty() && plan.shared.empty());
  EXPECT_EQ(plan.max_numel, 0u);
  EXPECT_EQ(plan.predicted_us, 0);
}

INSTANTIATE_TEST_SUITE_P(Policies, EmptyShardTest,
                         ::testing::Values("cpu", "static:1", "interleave:3", "auto"),
                         PolicyName);

TEST(StepPlannerTest, ZeroElementSubgroupsNeverDivideByZero) {
  StepPlanner planner(Gpu(/*resident_bytes=*/1000));
  StepPlan plan = planner.Plan(P("auto"), Uniform(3, 0));
  EXPECT_EQ(plan.resident, 0u);
  ExpectPartition(plan);
  EXPECT_EQ(plan.predicted_us, 0);
}

TEST(StepPlannerTest, HugeSubgroupsSizeTheStagingBuffers) {
  StepPlanner planner(Gpu());
  ShardLayout l;
  l.subgroup_numel = {10, uint64_t{3} << 32, 10};
  StepPlan plan = planner.Plan(P("interleave:1"), l);
  EXPECT_EQ(plan.max_numel, uint64_t{3} << 32);
  EXPECT_EQ(plan.streamed_params, (uint64_t{3} << 32) + 20);
  EXPECT_GT(plan.predicted_us, 0);
}

// --- budgets on bandwidth ----------------------------------------------------------

TEST(StepPlannerTest, ZeroCapsLeaveTheModelsInputsAlone) {
  PerfInputs in = H200();
  PerfInputs out = StepPlanner::Capped(in, PlanBudgets{});
  EXPECT_EQ(out.h2d_bytes_per_s, in.h2d_bytes_per_s);
  EXPECT_EQ(out.pcie_both_bytes_per_s, in.pcie_both_bytes_per_s);
  EXPECT_EQ(out.host_bytes_per_s, in.host_bytes_per_s);
}

TEST(StepPlannerTest, APcieCapSlowsTheGpuPathAndLowersItsShare) {
  StepPlanner free_planner(Gpu());
  PlannerOptions capped = Gpu();
  capped.budgets.pcie_bytes_per_s = 10e9;
  StepPlanner capped_planner(capped);
  StepPlan a = free_planner.Plan(P("auto"), Uniform(20));
  StepPlan b = capped_planner.Plan(P("auto"), Uniform(20));
  EXPECT_EQ(b.inputs.h2d_bytes_per_s, 10e9);
  EXPECT_EQ(b.inputs.pcie_both_bytes_per_s, 20e9);
  EXPECT_LT(b.gpu_share, a.gpu_share);
  EXPECT_GT(b.predicted_us, a.predicted_us);
}

TEST(StepPlannerTest, AHostMemoryCapBindsTheStep) {
  PlannerOptions o = Gpu();
  o.budgets.host_bytes_per_s = 20e9;
  StepPlanner planner(o);
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  EXPECT_EQ(plan.binding, "host_memory");
}

// --- layouts -------------------------------------------------------------------------

TEST(StepPlannerTest, LayoutOfAShardReadsSubgroupsAndTensorZerosDtypes) {
  HostMemoryBudget budget(0);
  std::vector<TensorDesc> tensors(2);
  tensors[0].param_dtype = DType::kBF16;
  tensors[0].grad_dtype = DType::kF16;
  tensors[0].numel = 250;
  tensors[1].numel = 100;
  absl::StatusOr<std::unique_ptr<ShardState>> shard =
      ShardState::Create(tensors, {GroupConfig{}}, 100, &budget, "test");
  ASSERT_TRUE(shard.ok()) << shard.status();
  ShardLayout l = ShardLayout::Of(**shard, /*grad_fp32=*/false);
  EXPECT_EQ(l.subgroup_numel, (std::vector<uint64_t>{100, 100, 100, 50}));
  EXPECT_EQ(l.grad_bytes, 2);
  EXPECT_EQ(l.weight_bytes, 2);
  EXPECT_EQ(ShardLayout::Of(**shard, /*grad_fp32=*/true).grad_bytes, 4);
}

TEST(StepPlannerTest, TransferSizesOfTheLayoutReachTheModel) {
  StepPlanner planner(Gpu());
  ShardLayout l = Uniform(4);
  l.grad_bytes = 4;
  l.weight_bytes = 4;
  StepPlan plan = planner.Plan(P("auto"), l);
  EXPECT_EQ(plan.inputs.grad_bytes, 4);
  EXPECT_EQ(planner.model_inputs().weight_bytes, 4);
  // fp32 weights cost the CPU path more PCIe: the GPU's share grows or the
  // rate falls relative to 16-bit.
  StepPlan sixteen = planner.Plan(P("auto"), Uniform(4));
  EXPECT_GE(PerfModel::Bound(sixteen.inputs, sixteen.gpu_share).params_per_s,
            PerfModel::Bound(plan.inputs, plan.gpu_share).params_per_s);
}

// --- learning ----------------------------------------------------------------------------

TEST(StepPlannerTest, TheCpuPathRateStartsAsAShareOfTheKernelRate) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(4));
  EXPECT_DOUBLE_EQ(plan.cpu_path_rate, 0.6 * 3.7e9);
  EXPECT_EQ(plan.gpu_path_rate, 0);
  EXPECT_EQ(planner.cpu_path_rate(), 0);
}

TEST(StepPlannerTest, LearnsKernelAndCopyRatesByEwma) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("interleave:2"), Uniform(4));
  StepMeasurements m;
  m.cpu_params = 2 * kSg;
  m.cpu_kernel_us = 2 * kSg / 2e9 * 1e6;     // 2 Gparam/s
  m.gpu_params = 2 * kSg;
  m.gpu_kernel_us = 2 * kSg / 100e9 * 1e6;   // 100 Gparam/s
  m.gpu_h2d_bytes = m.gpu_d2h_bytes = 24 * kSg;
  m.h2d_us = 24 * kSg / 40e9 * 1e6;          // 40 GB/s
  m.d2h_us = 24 * kSg / 30e9 * 1e6;          // 30 GB/s
  planner.Learn(plan, m);
  PerfInputs in = planner.model_inputs();
  EXPECT_NEAR(in.cpu_params_per_s, 0.7 * 3.7e9 + 0.3 * 2e9, 1e3);
  EXPECT_NEAR(in.gpu_params_per_s, 0.7 * 120e9 + 0.3 * 100e9, 1e4);
  EXPECT_NEAR(in.h2d_bytes_per_s, 0.7 * 55e9 + 0.3 * 40e9, 1e4);
  EXPECT_NEAR(in.d2h_bytes_per_s, 0.7 * 55e9 + 0.3 * 30e9, 1e4);
}

TEST(StepPlannerTest, PathRatesTakeTheFirstSampleThenAverage) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(4));
  StepMeasurements m;
  m.cpu_params = 1000;
  m.cpu_loop_us = 1;  // 1e9 params/s
  m.streamed_params = 2000;
  m.gpu_loop_us = 1;  // 2e9
  planner.Learn(plan, m);
  EXPECT_DOUBLE_EQ(planner.cpu_path_rate(), 1e9);
  EXPECT_DOUBLE_EQ(planner.gpu_path_rate(), 2e9);
  m.cpu_loop_us = 0.5;  // 2e9
  planner.Learn(plan, m);
  EXPECT_DOUBLE_EQ(planner.cpu_path_rate(), 0.7 * 1e9 + 0.3 * 2e9);
  StepPlan next = planner.Plan(P("auto"), Uniform(4));
  EXPECT_DOUBLE_EQ(next.cpu_path_rate, planner.cpu_path_rate());
  EXPECT_DOUBLE_EQ(next.gpu_path_rate, 2e9);
}

TEST(StepPlannerTest, MeasurementsWithoutTimeTeachNothing) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(4));
  StepMeasurements m;
  m.cpu_params = 1000;      // no kernel or loop time
  m.gpu_params = 1000;
  m.gpu_h2d_bytes = 12000;  // no copy time
  planner.Learn(plan, m);
  PerfInputs in = planner.model_inputs();
  EXPECT_EQ(in.cpu_params_per_s, 3.7e9);
  EXPECT_EQ(in.gpu_params_per_s, 120e9);
  EXPECT_EQ(in.h2d_bytes_per_s, 55e9);
  EXPECT_EQ(planner.cpu_path_rate(), 0);
}

TEST(StepPlannerTest, HostBandwidthRisesOnlyWhenBothPathsRanAndMovedMore) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(4));
  StepMeasurements cpu_only;
  cpu_only.cpu_params = 4 * kSg;
  cpu_only.wall_us = 1;  // absurdly fast, but the GPU path did not run
  planner.Learn(plan, cpu_only);
  EXPECT_EQ(planner.model_inputs().host_bytes_per_s, 145e9);
  StepMeasurements both;
  both.cpu_params = kSg;
  both.gpu_h2d_bytes = 12 * kSg;
  both.wall_us = 1e6;  // 32 B x 1e8 + 2 x 12e8 = 5.6 GB in 1 s: below 145 GB/s
  planner.Learn(plan, both);
  EXPECT_EQ(planner.model_inputs().host_bytes_per_s, 145e9);
  both.wall_us = 0.02e6;  // 5.6 GB in 20 ms = 280 GB/s
  planner.Learn(plan, both);
  EXPECT_NEAR(planner.model_inputs().host_bytes_per_s, 280e9, 1e6);
}

TEST(StepPlannerTest, ASlowMeasuredCpuMovesAutosShareToTheGpu) {
  StepPlanner planner(Gpu());
  const double x0 = planner.Plan(P("auto"), Uniform(20)).gpu_share;
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  StepMeasurements m;
  m.cpu_params = kSg;
  m.cpu_kernel_us = kSg / 0.5e9 * 1e6;  // 0.5 Gparam/s, many times
  for (int i = 0; i < 10; ++i) planner.Learn(plan, m);
  EXPECT_GT(planner.Plan(P("auto"), Uniform(20)).gpu_share, x0);
}

// --- the claiming rule --------------------------------------------------------------------

TEST(StepPlannerTest, AnIdleGpuTakesASharedSubgroupWhenTheCpuHasMuchLeft) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  EXPECT_TRUE(plan.TakeShared({.numel = kSg, .shared_left = 10 * kSg}, /*in_flight=*/0));
}

TEST(StepPlannerTest, ABusyGpuLeavesTheLastSharedSubgroupToTheCpu) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  // Three subgroups already in the pipeline; one shared subgroup left: the
  // CPU finishes it sooner than the GPU would.
  EXPECT_FALSE(plan.TakeShared({.numel = kSg, .shared_left = kSg}, /*in_flight=*/3));
}

TEST(StepPlannerTest, ABusyGpuTakesTheLastSharedSubgroupWhenTheCpuStillHoldsMuch) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  // As above, but the CPU has three subgroups of its own still to update:
  // it would reach the shared one only after them.
  EXPECT_FALSE(plan.TakeShared({.numel = kSg, .shared_left = kSg}, /*in_flight=*/3));
  EXPECT_TRUE(
      plan.TakeShared({.numel = kSg, .shared_left = kSg, .cpu_left = 6 * kSg}, /*in_flight=*/3));
}

TEST(StepPlannerTest, TheClaimingRuleUsesTheMeasuredGpuPathRate) {
  StepPlanner planner(Gpu());
  StepPlan plan = planner.Plan(P("auto"), Uniform(20));
  const bool before = plan.TakeShared({.numel = kSg, .shared_left = 4 * kSg}, 2);
  plan.gpu_path_rate = 1e6;  // a GPU path measured to be hopeless
  EXPECT_FALSE(plan.TakeShared({.numel = kSg, .shared_left = 4 * kSg}, 2));
  EXPECT_TRUE(before);
}

// --- the queue a plan makes -----------------------------------------------------------------

TEST(StepPlannerTest, ThePlansQueueHandsOutEveryNonResidentSubgroupOnce) {
  StepPlanner planner(Gpu(/*resident_bytes=*/kSg * 12));
  StepPlan plan = planner.Plan(P("auto"), Uniform(12));
  SubgroupQueue q = plan.MakeQueue();
  std::set<uint32_t> got;
  for (int idle = 0; idle < 2;) {
    std::optional<uint32_t> g = q.ClaimGpu([](const SubgroupQueue::SharedClaim&) { return true; });
    std::optional<uint32_t> c = q.ClaimCpu();
    idle = (g || c) ? 0 : idle + 1;
    if (g) {
      EXPECT_TRUE(got.insert(*g).second) << *g;
    }
    if (c) {
      EXPECT_TRUE(got.insert(*c).second) << *c;
    }
  }
  const std::vector<uint32_t> want = Range(1, 12);
  EXPECT_EQ(got, std::set<uint32_t>(want.begin(), want.end()));
}

// --- timeline -------------------------------------------------------------------------------

TEST(StepPlannerTest, TimelineLineListsEveryEntry) {
  std::vector<TimelineEntry> entries = {{3, 'g', 1, 2, 3, 4, 5, 6}, {0, 'c', 0, 1, 1, 2, 2, 3}};
  std::string line = TimelineLine(7, P("interleave:2"), 100, 90, entries);
  EXPECT_EQ(line,
            "{\"step\":7,\"policy\":\"interleave:2\",\"wall_us\":100.0,\"predicted_us\":90.0,"
            "\"entries\":[{\"sg\":3,\"path\":\"g\",\"in\":[1.0,2.0],\"kernel\":[3.0,4.0],"
            "\"out\":[5.0,6.0]},{\"sg\":0,\"path\":\"c\",\"in\":[0.0,1.0],\"kernel\":[1.0,2.0],"
            "\"out\":[2.0,3.0]}]}\n");
}

TEST(StepPlannerTest, LearnAppendsOneTimelineLinePerGpuStep) {
  const std::string path = ::testing::TempDir() + "/planner_timeline.jsonl";
  std::remove(path.c_str());
  PlannerOptions o = Gpu();
  o.timeline_path = path;
  StepPlanner planner(o);
  StepPlan plan = planner.Plan(P("cpu"), Uniform(2));
  StepMeasurements m;
  m.entries = {{0, 'c'}, {1, 'c'}};
  planner.Learn(plan, m);
  planner.Learn(plan, m);
  std::ifstream in(path);
  std::string l1, l2, l3;
  ASSERT_TRUE(std::getline(in, l1));
  ASSERT_TRUE(std::getline(in, l2));
  EXPECT_FALSE(std::getline(in, l3));
  EXPECT_EQ(l1.rfind("{\"step\":1,\"policy\":\"cpu\"", 0), 0u) << l1;
  EXPECT_EQ(l2.rfind("{\"step\":2,", 0), 0u) << l2;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace dos
