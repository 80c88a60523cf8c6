// The node model replayed on the measurements of `bench/device_session.sh
// ranks` on nvidia-h200-x2 (2026-11-30, commit d8a649e; logs summarised in
// bench/e2e/README.md, "Several ranks, one daemon"): one dosd, two GPU
// engines, 1.5B parameters per rank in 16 subgroups, --gpu_memory_budget=8G
// (7 subgroups resident, 9 streamed: 56% of the state on the host), `auto`,
// 3 warm-up and 6 timed steps; first 1 rank alone, then 2 DDP ranks.
//
// What the run measured (dosctl stats: the executor's update wall; ranks.py:
// the trainer's opt.step()):
//   1 rank:  executor 0.1906 s, trainer 0.2046 s; predicted 0.1967.
//   2 ranks: executor 0.2788 / 0.2713 s, trainer 0.2833 / 0.2836 s;
//            predicted 0.326 / 0.336 (errors 15-19%), node M_host learned
//            148.9 GB/s, node bound 9.19 Gparam/s below the 10.90 measured.
// Reconstructed per-step measurements (the engines' reports were not
// logged; the assumptions):
//   - Per-engine rates as the bandwidth probe measured them (bench/update,
//     probe.json: H2D 54.48 GB/s, D2H 55.16, GPU kernel 123.7 Gparam/s,
//     M_host 135.3 GB/s seeding dosd through --model_host_gbps); B_both the
//     built-in 95 GB/s (dosd does not learn it); R_cpu the built-in 4.0e9.
//   - 1 rank runs the plan's split (the claiming rule rounds x to whole
//     subgroups); its CPU kernel runs at the probe's rate under DMA, 2.55
//     Gparam/s, and its copies at the probe's link rates.
//   - 2 ranks: the plans are host-memory bound at x = 1 (binding
//     "host_memory" in the stats), so every streamed subgroup takes the GPU
//     path (12 B of state each way); the copy engines are busy for the whole
//     streaming time (host-limited copies).
// The old model (M_host raised to the node's bytes over the time since each
// step's Begin, no per-engine ceiling) learned 148.9 and predicted 0.33 s;
// the model now must predict each rank within 10% of both timings, put the
// node bound within 10% of the measured aggregate, and still predict 1 rank
// alone within 10% after the node learned what 2 ranks draw together.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <utility>

#include "daemon/sched/node_resources.h"
#include "daemon/sched/step_planner.h"
#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

using testing::UniformLayout;

constexpr uint64_t kSubgroup = 96'581'376;  // 1,545,302,016 / 16
constexpr uint32_t kSubgroups = 16;
constexpr uint64_t kBudget = 8ull << 30;  // --gpu_memory_budget=8G: 7 subgroups

struct MicroClock {
  std::atomic<int64_t> us{1'000'000'000};
  absl::Time Now() const { return absl::FromUnixMicros(us.load()); }
  void Advance(double s) { us += static_cast<int64_t>(std::llround(s * 1e6)); }
};

PerfInputs ProbeSeed() {
  PerfInputs in;  // built-in cpu 4.0e9, B_both 95e9
  in.h2d_bytes_per_s = 54.48e9;
  in.d2h_bytes_per_s = 55.16e9;
  in.gpu_params_per_s = 123.73e9;
  in.host_bytes_per_s = 135.31e9;
  return in;
}

// What a GPU engine reports for a step of `plan` that ran `cpu_subgroups` of
// its streamed subgroups on the CPU path in `wall_s`.
StepMeasurements Report(const StepPlan& plan, uint32_t cpu_subgroups, double wall_s, double h2d_s,
                        double d2h_s) {
  StepMeasurements m;
  const uint32_t streamed = plan.num_subgroups - plan.resident;
  const uint32_t gpu = streamed - cpu_subgroups;
  m.cpu_params = uint64_t{cpu_subgroups} * kSubgroup;
  m.streamed_params = uint64_t{gpu} * kSubgroup;
  m.gpu_params = m.streamed_params + plan.resident_params;
  m.gpu_h2d_bytes = m.streamed_params * 12;
  m.gpu_d2h_bytes = m.streamed_params * 12;
  m.cpu_d2h_bytes = m.cpu_params * 2;
  m.cpu_h2d_bytes = m.cpu_params * 2;
  m.cpu_kernel_us = m.cpu_params / 2.55e9 * 1e6;
  m.gpu_kernel_us = m.gpu_params / 123.73e9 * 1e6;
  m.h2d_us = h2d_s * 1e6;
  m.d2h_us = d2h_s * 1e6;
  m.cpu_loop_us = cpu_subgroups > 0 ? wall_s * 1e6 : 0;
  m.gpu_loop_us = wall_s * 1e6;
  m.wall_us = wall_s * 1e6;
  return m;
}

double Err(double predicted_us, double measured_s) {
  return std::abs(predicted_us * 1e-6 - measured_s) / measured_s;
}

class NodeReplayTest : public ::testing::Test {
 protected:
  NodeReplayTest() : node_(Options()) {
    for (int i = 0; i < 2; ++i) {
      PlannerOptions o;
      o.budgets.gpu = true;
      o.budgets.gpu_resident_bytes = kBudget;
      o.initial = ProbeSeed();
      o.node = &node_;
      o.node_engine = node_.AddEngine(i == 0 ? "cuda:0" : "cuda:1", o.initial);
      planners_[i] = std::make_unique<StepPlanner>(o);
    }
    resident_ = StepPlanner::ResidentCount(kAuto, layout_, planners_[0]->budgets());
  }
  NodeResources::Options Options() {
    NodeResources::Options o;
    o.now = [this] { return clock_.Now(); };
    return o;
  }

  // One step of rank 0 alone, as the executor runs it; returns the plan.
  StepPlan StepAlone(double wall_s) {
    NodeResources::Step s = planners_[0]->BeginStep(layout_, resident_);
    const StepPlan plan = planners_[0]->Plan(kAuto, layout_, resident_);
    const uint32_t streamed = kSubgroups - resident_;
    const uint32_t gpu = static_cast<uint32_t>(std::lround(plan.gpu_share * streamed));
    const StepMeasurements m = Report(plan, streamed - gpu, wall_s, gpu * kSubgroup * 12 / 54.48e9,
                                      gpu * kSubgroup * 12 / 55.16e9);
    clock_.Advance(wall_s);
    s.Finish(StepPlanner::NodeStepEnd(plan, m));
    planners_[0]->Learn(plan, m);
    clock_.Advance(0.25);  // forward and backward of the next iteration
    return plan;
  }

  // One lockstep step of both ranks (DDP after a barrier): both begin and
  // plan, rank 1 ends first (its executor wall 0.2713 s), rank 0 after
  // (0.2788 s). Returns the plans.
  std::pair<StepPlan, StepPlan> StepTogether() {
    const double wall[2] = {0.2788, 0.2713};
    NodeResources::Step s0 = planners_[0]->BeginStep(layout_, resident_);
    NodeResources::Step s1 = planners_[1]->BeginStep(layout_, resident_);
    const StepPlan p0 = planners_[0]->Plan(kAuto, layout_, resident_);
    const StepPlan p1 = planners_[1]->Plan(kAuto, layout_, resident_);
    auto report = [&](const StepPlan& p, double w) {
      const double flow = w - StepPlanner::NodeStepEnd(p, {}).other_s;
      return Report(p, 0, w, flow, flow);
    };
    const StepMeasurements m0 = report(p0, wall[0]), m1 = report(p1, wall[1]);
    clock_.Advance(wall[1]);
    s1.Finish(StepPlanner::NodeStepEnd(p1, m1));
    planners_[1]->Learn(p1, m1);
    clock_.Advance(wall[0] - wall[1]);
    s0.Finish(StepPlanner::NodeStepEnd(p0, m0));
    planners_[0]->Learn(p0, m0);
    clock_.Advance(0.25);
    return {p0, p1};
  }

  static constexpr Policy kAuto{Policy::Kind::kAuto};
  MicroClock clock_;
  NodeResources node_;
  std::unique_ptr<StepPlanner> planners_[2];
  const ShardLayout layout_ = UniformLayout(kSubgroups, kSubgroup);
  uint32_t resident_ = 0;
};

TEST_F(NodeReplayTest, PredictsOneAndTwoRanksOfTheX2Run) {
  ASSERT_EQ(resident_, 7u);
  // 1 rank: 3 warm-up and 6 timed steps (dosd's first session).
  StepPlan last;
  for (int i = 0; i < 9; ++i) {
    last = StepAlone(0.1906);
    EXPECT_DOUBLE_EQ(last.node_share, 1.0);
    // At the crossing of host memory and B_both (either may be named).
    EXPECT_TRUE(last.binding == "host_memory" || last.binding == "pcie_both") << last.binding;
    if (i >= 3) {
      std::printf("1 rank step %d: predicted %.4f s (x %.3f, %s)\n", i, last.predicted_us * 1e-6,
                  last.gpu_share, last.binding.c_str());
      EXPECT_LT(Err(last.predicted_us, 0.1906), 0.10) << "step " << i;
      EXPECT_LT(Err(last.predicted_us, 0.2046), 0.10) << "step " << i;
    }
  }
  const double one_rank_predicted_us = last.predicted_us;
  // The session closes; 20 s later the 2 ranks attach.
  clock_.Advance(20);
  for (int i = 0; i < 9; ++i) {
    const auto [p0, p1] = StepTogether();
    EXPECT_DOUBLE_EQ(p0.node_share, 0.5);
    EXPECT_DOUBLE_EQ(p1.node_share, 0.5);
    std::printf("2 ranks step %d: predicted %.4f / %.4f s, node M_host %.1f GB/s, bound %.2f\n", i,
                p0.predicted_us * 1e-6, p1.predicted_us * 1e-6,
                node_.Snapshot().host_bytes_per_s * 1e-9,
                node_.Snapshot().bound_params_per_s * 1e-9);
    if (i < 3) continue;  // warm-up: the first step plans before the node saw two ranks
    EXPECT_LT(Err(p0.predicted_us, 0.2788), 0.10) << "step " << i;
    EXPECT_LT(Err(p1.predicted_us, 0.2713), 0.10) << "step " << i;
    EXPECT_LT(Err(p0.predicted_us, 0.2833), 0.10) << "step " << i;
    EXPECT_LT(Err(p1.predicted_us, 0.2836), 0.10) << "step " << i;
    EXPECT_EQ(p0.binding, "host_memory");
    // The node bound beside the aggregate the trainer measured (2 x 1.545B
    // over the slower rank's 0.2836 s: 10.90 Gparam/s), within 10%.
    const NodeResources::View v = node_.Snapshot();
    ASSERT_EQ(v.active, 2u);
    const double aggregate = 2.0 * kSubgroups * kSubgroup / 0.2836;
    EXPECT_LT(std::abs(v.bound_params_per_s - aggregate) / aggregate, 0.10) << "step " << i;
  }
  // Two ranks drew ~165 GB/s of host traffic together, more than one alone
  // (~137: its own ceiling, which the probe measured and its steps kept).
  const NodeResources::View v = node_.Snapshot();
  EXPECT_GT(v.host_bytes_per_s, 155e9);
  EXPECT_LT(v.host_bytes_per_s, 175e9);
  EXPECT_LT(v.engines[0].host_alone_bytes_per_s, 150e9);
  EXPECT_DOUBLE_EQ(v.engines[1].host_alone_bytes_per_s, 135.31e9);  // never alone
  // Rank 0 alone again, after the node learned two ranks together: its own
  // ceiling, not the node's, limits it; still within 10% of what 1 rank took.
  clock_.Advance(60);
  const StepPlan again = StepAlone(0.1906);
  EXPECT_DOUBLE_EQ(again.node_share, 1.0);
  std::printf("1 rank again: predicted %.4f s (engine ceiling %.1f GB/s)\n",
              again.predicted_us * 1e-6, v.engines[0].host_alone_bytes_per_s * 1e-9);
  EXPECT_LT(Err(again.predicted_us, 0.1906), 0.10);
  EXPECT_LT(Err(again.predicted_us, 0.2046), 0.10);
  EXPECT_NEAR(again.predicted_us, one_rank_predicted_us, 0.05 * one_rank_predicted_us);
}

// The traffic rate the node learns is the host bytes over the time they
// flowed: the executor's wall less the model's fill/drain and resident
// terms, not the time since Begin (which holds the plan, the prefetch and
// the verdict wait).
TEST(NodeReplayRulesTest, TrafficFlowsOverTheUpdateLessTheOtherTerms) {
  MicroClock clock;
  NodeResources::Options o;
  o.now = [&clock] { return clock.Now(); };
  NodeResources node(o);
  PerfInputs seed = ProbeSeed();
  seed.host_bytes_per_s = 50e9;
  const int a = node.AddEngine("cuda:0", seed);
  node.Begin(a, 1000);
  clock.Advance(0.5);  // plan, prefetch, verdict: no traffic measured
  clock.Advance(1.0);  // the update
  node.End(a, {.share = 1.0, .measured_us = 1e6, .host_bytes = 80e9, .other_s = 0.2});
  const NodeResources::View v = node.Snapshot();
  EXPECT_NEAR(v.host_bytes_per_s, 100e9, 1e3);  // 80 GB over 0.8 s
  EXPECT_NEAR(v.engines[0].host_alone_bytes_per_s, 100e9, 1e3);
  // An update that was nearly all fill and drain teaches nothing.
  node.Begin(a, 1000);
  clock.Advance(1.0);
  node.End(a, {.share = 1.0, .measured_us = 1e6, .host_bytes = 80e9, .other_s = 0.9});
  EXPECT_NEAR(node.Snapshot().host_bytes_per_s, 100e9, 1e3);
}

// Alone, an engine plans with its own ceiling; beside another, with its
// share of the node's, even where the node's is above the engine's.
TEST(NodeReplayRulesTest, AnEnginePlansWithTheLesserOfItsCeilingAndItsShare) {
  MicroClock clock;
  NodeResources::Options o;
  o.now = [&clock] { return clock.Now(); };
  NodeResources node(o);
  const int a = node.AddEngine("cuda:0", ProbeSeed());
  const int b = node.AddEngine("cuda:1", ProbeSeed());
  node.Begin(a, 1000);
  node.Begin(b, 1000);
  clock.Advance(1.0);
  node.End(a, {.share = 0.5, .measured_us = 1e6, .host_bytes = 90e9});
  node.End(b, {.share = 0.5, .measured_us = 1e6, .host_bytes = 90e9});
  EXPECT_NEAR(node.Snapshot().host_bytes_per_s, 180e9, 1e3);
  EXPECT_NEAR(node.Apply(a, ProbeSeed(), 1.0).host_bytes_per_s, 135.31e9, 1e3);
  EXPECT_NEAR(node.Apply(a, ProbeSeed(), 0.5).host_bytes_per_s, 90e9, 1e3);
  EXPECT_NEAR(node.Apply(ProbeSeed(), 1.0).host_bytes_per_s, 180e9, 1e3);  // the node's
}

}  // namespace
}  // namespace dos
