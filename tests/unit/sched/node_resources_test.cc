// NodeResources: the GPU engines' shared view of the host. An engine alone
// gets all of the host's memory bandwidth and cores; engines stepping at the
// same time split them by host demand; the planners' plans and predictions
// follow the share; the node learns its rates from shared steps; and many
// engines stepping from many threads leave it consistent (run under TSan in
// CI's sanitizer stage). Executors stepping together on fake GPUs:
// node_executors_test.cc.
#include "daemon/sched/node_resources.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/sched/step_planner.h"
#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

using testing::GpuPlannerOptions;
using testing::H200Rates;
using testing::UniformLayout;

// A clock the test moves by hand.
struct FakeClock {
  std::atomic<int64_t> ms{1'000'000};
  absl::Time Now() const { return absl::FromUnixMillis(ms.load()); }
  void Advance(int64_t d) { ms += d; }
};

NodeResources::Options WithClock(FakeClock* clock) {
  NodeResources::Options o;
  o.now = [clock] { return clock->Now(); };
  return o;
}

TEST(NodeResourcesTest, AnEngineAloneGetsTheWholeHost) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  const int a = node.AddEngine("cuda:0", H200Rates());
  node.AddEngine("cuda:1", H200Rates());  // never steps
  EXPECT_EQ(node.engines(), 2);
  EXPECT_DOUBLE_EQ(node.Begin(a, 1000), 1.0);
  const PerfInputs in = node.Apply(H200Rates(), 1.0);
  EXPECT_DOUBLE_EQ(in.host_bytes_per_s, H200Rates().host_bytes_per_s);
  EXPECT_DOUBLE_EQ(in.cpu_params_per_s, H200Rates().cpu_params_per_s);
  node.End(a, {.share = 1.0});
  NodeResources::View v = node.Snapshot();
  EXPECT_EQ(v.active, 1u);
  EXPECT_TRUE(v.engines[0].active);
  EXPECT_FALSE(v.engines[1].active);
  EXPECT_DOUBLE_EQ(v.engines[0].share, 1.0);
}

TEST(NodeResourcesTest, TwoEnginesSteppingTogetherGetHalfEach) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  const int a = node.AddEngine("cuda:0", H200Rates());
  const int b = node.AddEngine("cuda:1", H200Rates());
  EXPECT_DOUBLE_EQ(node.Begin(a, 1000), 1.0);  // b has not started yet
  EXPECT_DOUBLE_EQ(node.Begin(b, 1000), 0.5);
  EXPECT_DOUBLE_EQ(node.Share(a), 0.5);
  const PerfInputs half = node.Apply(H200Rates(), node.Share(b));
  EXPECT_DOUBLE_EQ(half.host_bytes_per_s, 0.5 * H200Rates().host_bytes_per_s);
  EXPECT_DOUBLE_EQ(half.cpu_params_per_s, 0.5 * H200Rates().cpu_params_per_s);
  EXPECT_DOUBLE_EQ(half.h2d_bytes_per_s, H200Rates().h2d_bytes_per_s);  // its own link
  node.End(a, {.share = 1.0});
  node.End(b, {.share = 0.5});
  // Lockstep: the next step of either counts the other, which stepped just now.
  clock.Advance(300);
  EXPECT_DOUBLE_EQ(node.Begin(a, 1000), 0.5);
  node.End(a, {.share = 0.5});
  // An engine that stops stepping gives its share back after the window.
  clock.Advance(5'000);
  EXPECT_DOUBLE_EQ(node.Begin(a, 1000), 1.0);
  node.End(a, {.share = 1.0});
  EXPECT_EQ(node.Snapshot().active, 1u);
}

TEST(NodeResourcesTest, SharesFollowHostDemand) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  const int a = node.AddEngine("cuda:0", H200Rates());
  const int b = node.AddEngine("cuda:1", H200Rates());
  node.Begin(a, 3000);
  // b's resident tier holds three quarters of what a streams: it needs, and
  // gets, a quarter of the host.
  EXPECT_DOUBLE_EQ(node.Begin(b, 1000), 0.25);
  EXPECT_DOUBLE_EQ(node.Share(a), 0.75);
  node.End(a, {});
  node.End(b, {});
  // b all resident: a sliver, never zero.
  node.Begin(a, 3000);
  EXPECT_DOUBLE_EQ(node.Begin(b, 0), 0.01);
  node.End(a, {});
  node.End(b, {});
  // All resident everywhere: equal shares (nobody needs the host).
  node.Begin(a, 0);
  EXPECT_DOUBLE_EQ(node.Begin(b, 0), 0.5);
  node.End(a, {});
  node.End(b, {});
}

// Two sessions on one GPU step at once: their engine's demand is theirs
// together until one ends.
TEST(NodeResourcesTest, OverlappingStepsOfOneEngineAddTheirDemand) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  const int a = node.AddEngine("cuda:0", H200Rates());
  const int b = node.AddEngine("cuda:1", H200Rates());
  node.Begin(a, 1000);
  node.Begin(a, 1000);
  EXPECT_DOUBLE_EQ(node.Begin(b, 2000), 0.5);
  node.End(a, {.share = 0.5}, 1000);
  EXPECT_NEAR(node.Share(b), 2.0 / 3, 1e-12);
  EXPECT_EQ(node.Snapshot().active, 2u);
  node.End(a, {.share = 0.5}, 1000);
  node.End(b, {.share = 0.5}, 2000);
  // Ended more often than begun: ignored.
  node.End(b, {.share = 0.5}, 2000);
  clock.Advance(60'000);
  EXPECT_EQ(node.Snapshot().active, 0u);
  EXPECT_DOUBLE_EQ(node.Begin(b, 2000), 1.0);
  node.End(b, {});
}

TEST(NodeResourcesTest, LearnsTheNodeFromSharedSteps) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  PerfInputs initial = H200Rates();
  initial.host_bytes_per_s = 100e9;
  const int a = node.AddEngine("cuda:0", initial);
  const int b = node.AddEngine("cuda:1", initial);
  // Both step for one second, each moving 80 GB of host traffic: together
  // 160 GB/s, more than the 100 assumed. Each ran its CPU kernel at half the
  // node: 2e9 params in a second at share 0.5 is a node rate of 4e9.
  node.Begin(a, 1000);
  node.Begin(b, 1000);
  clock.Advance(1000);
  NodeResources::StepEnd end{.share = 0.5, .measured_us = 1e6, .cpu_params = 2e9,
                             .cpu_busy_s = 1.0, .host_bytes = 80e9};
  node.End(a, end);
  EXPECT_DOUBLE_EQ(node.Snapshot().host_bytes_per_s, 100e9);  // 80 alone: not more
  node.End(b, end);
  NodeResources::View v = node.Snapshot();
  EXPECT_NEAR(v.host_bytes_per_s, 160e9, 1e6);
  // R_cpu (EWMA, weight 0.3 per sample): 3.7e9 -> 3.79e9 -> 3.853e9.
  EXPECT_NEAR(v.cpu_params_per_s, 3.853e9, 1e6);
  // A failed step (nothing measured) learns nothing and still ends.
  node.Begin(a, 1000);
  node.End(a, {.share = 1.0});
  EXPECT_NEAR(node.Snapshot().host_bytes_per_s, 160e9, 1e6);
}

// Planners over one node: alone, an engine plans with the whole host; with a
// second engine stepping, with half of it, and predicts accordingly. The
// node's bound is the active engines' parameters over the slowest prediction.
TEST(NodeResourcesTest, PlansAndPredictionsFollowTheShare) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  PlannerOptions oa = GpuPlannerOptions(), ob = GpuPlannerOptions();
  oa.node = &node;
  oa.node_engine = node.AddEngine("cuda:0", oa.initial);
  ob.node = &node;
  ob.node_engine = node.AddEngine("cuda:1", ob.initial);
  StepPlanner pa(oa), pb(ob);
  const ShardLayout layout = UniformLayout(16, 100'000'000);
  const Policy autop{Policy::Kind::kAuto};

  StepPlan alone;
  {
    NodeResources::Step s = pa.BeginStep(layout, 0);
    EXPECT_DOUBLE_EQ(s.share(), 1.0);
    alone = pa.Plan(autop, layout, 0);
  }
  EXPECT_DOUBLE_EQ(alone.node_share, 1.0);
  EXPECT_DOUBLE_EQ(alone.inputs.host_bytes_per_s, H200Rates().host_bytes_per_s);
  // Without a node the plan is what it always was.
  StepPlanner own(GpuPlannerOptions());
  const StepPlan reference = own.Plan(autop, layout, 0);
  EXPECT_DOUBLE_EQ(alone.predicted_us, reference.predicted_us);
  EXPECT_DOUBLE_EQ(alone.gpu_share, reference.gpu_share);

  clock.Advance(100);
  NodeResources::Step sa = pa.BeginStep(layout, 0);
  NodeResources::Step sb = pb.BeginStep(layout, 0);
  EXPECT_DOUBLE_EQ(sb.share(), 0.5);
  const StepPlan a = pa.Plan(autop, layout, 0);
  const StepPlan b = pb.Plan(autop, layout, 0);
  for (const StepPlan* p : {&a, &b}) {
    EXPECT_DOUBLE_EQ(p->node_share, 0.5);
    EXPECT_DOUBLE_EQ(p->inputs.host_bytes_per_s, 0.5 * H200Rates().host_bytes_per_s);
    EXPECT_DOUBLE_EQ(p->inputs.cpu_params_per_s, 0.5 * H200Rates().cpu_params_per_s);
    // Less host: slower, and more of the work moves to the GPU path.
    EXPECT_GT(p->predicted_us, alone.predicted_us);
    EXPECT_GE(p->gpu_share, alone.gpu_share);
    // The prediction is the model's at the share: the phase time at x.
    const double expect =
        PerfModel::PhaseSeconds(p->inputs, p->gpu_share, 16 * 1e8, 0, 1e8) * 1e6;
    EXPECT_DOUBLE_EQ(p->predicted_us, expect);
  }
  // Two engines at half the host each update less than twice one alone.
  NodeResources::View v = node.Snapshot();
  ASSERT_EQ(v.active, 2u);
  EXPECT_DOUBLE_EQ(v.engines[0].predicted_us, a.predicted_us);
  EXPECT_DOUBLE_EQ(v.engines[1].planned_share, 0.5);
  EXPECT_EQ(v.engines[1].params, 1'600'000'000u);
  EXPECT_DOUBLE_EQ(v.bound_params_per_s, 3.2e9 / (std::max(a.predicted_us, b.predicted_us) * 1e-6));
  EXPECT_LT(v.bound_params_per_s, 2 * 1.6e9 / (alone.predicted_us * 1e-6));
  EXPECT_GT(v.bound_params_per_s, 1.6e9 / (alone.predicted_us * 1e-6));
}

// A rank whose resident tier holds half its state plans its streamed half
// with the host share its demand earns.
TEST(NodeResourcesTest, AResidentTierRelievesTheHost) {
  FakeClock clock;
  NodeResources node(WithClock(&clock));
  const uint64_t sg_bytes = 100'000'000ull * 12;
  PlannerOptions oa = GpuPlannerOptions(8 * sg_bytes), ob = GpuPlannerOptions();
  oa.node = &node;
  oa.node_engine = node.AddEngine("cuda:0", oa.initial);
  ob.node = &node;
  ob.node_engine = node.AddEngine("cuda:1", ob.initial);
  StepPlanner pa(oa), pb(ob);
  const ShardLayout layout = UniformLayout(16, 100'000'000);
  const Policy autop{Policy::Kind::kAuto};
  const uint32_t ra = StepPlanner::ResidentCount(autop, layout, oa.budgets);
  EXPECT_EQ(ra, 8u);
  NodeResources::Step sa = pa.BeginStep(layout, ra);
  NodeResources::Step sb = pb.BeginStep(layout, 0);
  const StepPlan a = pa.Plan(autop, layout, ra);
  const StepPlan b = pb.Plan(autop, layout, 0);
  EXPECT_NEAR(a.node_share, 1.0 / 3, 1e-12);
  EXPECT_NEAR(b.node_share, 2.0 / 3, 1e-12);
  EXPECT_EQ(a.resident, 8u);
}

// Many engines beginning, planning and ending from many threads: shares
// always in (0, 1], and none left stepping at the end.
TEST(NodeResourcesTest, ManyThreadsKeepItConsistent) {
  NodeResources::Options options;
  options.min_window = absl::Hours(1);
  NodeResources node(options);
  constexpr int kEngines = 4, kSteps = 300;
  for (int i = 0; i < kEngines; ++i) node.AddEngine(absl::StrCat("cuda:", i), H200Rates());
  std::atomic<bool> bad{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kEngines; ++i) {
    threads.emplace_back([&, i] {
      for (int s = 0; s < kSteps; ++s) {
        NodeResources::Step step(&node, i, 1000 + 100 * i);
        const double share = node.Share(i);
        if (!(share > 0 && share <= 1) || !(step.share() > 0 && step.share() <= 1)) bad = true;
        const PerfInputs in = node.Apply(H200Rates(), share);
        node.Planned(i, 2000, share, 1e6 * 2000 / in.cpu_params_per_s, "cpu");
        if (s % 2 == 0) {
          step.Finish({.share = share, .measured_us = 10, .cpu_params = 1000, .cpu_busy_s = 1e-6,
                       .host_bytes = 1e4});
        }  // odd steps end in the destructor, as a failed step does
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(bad.load());
  NodeResources::View v = node.Snapshot();
  double total = 0;
  for (const NodeResources::EngineView& e : v.engines) total += e.share;
  EXPECT_NEAR(total, 1.0, 1e-9);  // every engine active (just stepped): shares sum to 1
}

}  // namespace
}  // namespace dos
