// Two StepExecutors on fake GPUs over one NodeResources, stepping from two
// threads: the node view wired through the executor's step (not under TSan:
// the CPU updater's oneTBB workers are not instrumented; the node's own
// threading is checked by node_resources_test.cc, which is).
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/sched/node_resources.h"
#include "daemon/sched/step_executor.h"
#include "tests/unit/sched/fake_engine.h"
#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

using testing::GpuPlannerOptions;

// Two executors on fake GPUs step their shards from two threads, in
// lockstep (a barrier per step, as DDP ranks do): after the first step each
// plans with half the host, every step ends (no engine left "stepping"),
// and the stats carry the share.
TEST(NodeExecutorsTest, TwoExecutorsSteppingConcurrently) {
  NodeResources::Options options;
  options.min_window = absl::Hours(1);  // a loaded CI machine may stall between steps
  NodeResources node(options);
  cpu::CpuUpdater cpu(cpu::CpuUpdaterOptions{.threads = 2});
  HostMemoryBudget budget{0};
  constexpr int kRanks = 2, kSteps = 12;
  struct Rank {
    std::unique_ptr<FakeEngine> engine;
    std::unique_ptr<StepExecutor> executor;
    std::unique_ptr<ShardState> shard;
    std::vector<float> param, grad;
    std::vector<TensorBinding> bindings;
    std::vector<double> shares;
  };
  std::vector<Rank> ranks(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    Rank& k = ranks[r];
    k.engine = std::make_unique<FakeEngine>(FakeEngine::Options{.gpu = true});
    PlannerOptions po = GpuPlannerOptions();
    po.node = &node;
    po.node_engine = node.AddEngine(absl::StrCat("cuda:", r), po.initial);
    k.executor = std::make_unique<StepExecutor>(k.engine.get(), po);
    std::vector<TensorDesc> tensors(1);
    tensors[0].numel = 8000;
    k.shard = *ShardState::Create(tensors, {GroupConfig{}}, 1000, &budget, "node");
    k.param.assign(8000, 0.5f);
    k.grad.assign(8000, 0.01f);
    k.bindings.push_back({k.param.data(), k.grad.data()});
    ASSERT_TRUE(k.executor->ReadWeights(*k.shard, k.bindings, 0).ok());
  }
  StepRequest req{};
  req.num_groups = 1;
  req.grad_scale = 1;
  req.clip_coef = 1;
  req.groups[0] = GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.0};
  std::barrier sync(kRanks);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      Rank& k = ranks[r];
      for (int s = 0; s < kSteps; ++s) {
        sync.arrive_and_wait();
        absl::StatusOr<StepOutcome> out =
            k.executor->Run(*k.shard, k.bindings, req, Policy{Policy::Kind::kAuto});
        if (!out.ok()) {
          ++failures;
          continue;
        }
        k.shares.push_back(out->node_share);
        (void)node.Snapshot();  // stats read while the other steps
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  for (const Rank& k : ranks) {
    ASSERT_EQ(k.shares.size(), static_cast<size_t>(kSteps));
    for (int s = 1; s < kSteps; ++s) EXPECT_DOUBLE_EQ(k.shares[s], 0.5) << "step " << s;
  }
  NodeResources::View v = node.Snapshot();
  EXPECT_EQ(v.active, 2u);
  for (const NodeResources::EngineView& e : v.engines) {
    EXPECT_EQ(e.params, 8000u);
    EXPECT_GT(e.predicted_us, 0);
    EXPECT_GT(e.measured_us, 0);
    EXPECT_DOUBLE_EQ(e.share, 0.5);
  }
  EXPECT_GT(v.bound_params_per_s, 0);
}

}  // namespace
}  // namespace dos
