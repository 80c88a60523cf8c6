// The resident tier sized from each session's GPU lease (issue 14): the
// planner's per-session budgets (lease less staging, the node-wide cap shared
// in proportion, sessions without a lease, static within a lease), and the
// executor on the fake engine: a lowered lease is given back in ApplyLease,
// before the step runs; growth stops where the device is full and the plan
// follows what the engine holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "daemon/sched/delayed_host.h"
#include "daemon/sched/step_executor.h"
#include "daemon/sched/step_kind.h"
#include "daemon/sched/step_planner.h"
#include "daemon/state/shard_state.h"
#include "tests/unit/sched/fake_engine.h"

namespace dos {
namespace {

constexpr uint64_t kSg = 1000;               // elements per subgroup
constexpr uint64_t kSgBytes = kSg * 12;      // its state
constexpr uint64_t kStaging = 2 * kSgBytes;  // two staging slots (the default)

ShardLayout Uniform(uint32_t n) {
  ShardLayout l;
  l.subgroup_numel.assign(n, kSg);
  return l;
}

PlannerOptions Gpu(uint64_t cap = 0) {
  PlannerOptions o;
  o.budgets.gpu = true;
  o.budgets.gpu_resident_bytes = cap;
  return o;
}

GpuLease Lease(uint64_t bytes) {
  return GpuLease{.reported = true, .lease_bytes = bytes, .budget_bytes = 80, .peak_bytes = 20};
}

Policy P(absl::string_view text) { return *ParsePolicy(text); }

TEST(ResidentTierTest, ALeaseLessTheStagingSizesTheTier) {
  StepPlanner planner(Gpu());
  const ShardLayout layout = Uniform(10);
  EXPECT_EQ(planner.sessions().StagingBytes(layout), kStaging);
  planner.sessions().SetLease(7, Lease(kStaging + 4 * kSgBytes + kSgBytes / 2), layout);
  EXPECT_EQ(planner.sessions().ResidentBytes(7), 4 * kSgBytes + kSgBytes / 2);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 7), 4u);
  const StepPlan plan = planner.Plan(P("auto"), layout, 4);
  EXPECT_EQ(plan.resident, 4u);
  EXPECT_EQ(plan.resident_params, 4 * kSg);
  EXPECT_EQ(plan.streamed_params, 6 * kSg);
  // A lease that does not even pay for the staging holds nothing resident.
  planner.sessions().SetLease(7, Lease(kStaging - 1), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 7), 0u);
  // A lease larger than the shard holds the whole shard.
  planner.sessions().SetLease(7, Lease(uint64_t{1} << 40), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 7), 10u);
  EXPECT_EQ(planner.sessions().LeaseOf(7).budget_bytes, 80u);
}

TEST(ResidentTierTest, TheTierGrowsAndShrinksWithTheLeaseAndKeepsItBetweenReports) {
  StepPlanner planner(Gpu());
  const ShardLayout layout = Uniform(8);
  planner.sessions().SetLease(1, Lease(kStaging + 2 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 2u);
  planner.sessions().SetLease(1, Lease(kStaging + 6 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 6u);
  planner.sessions().SetLease(1, GpuLease{}, layout);  // a step without the flag keeps the lease
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 6u);
  planner.sessions().SetLease(1, Lease(kStaging + 1 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 1u);
  // Other policies: cpu and interleave keep nothing resident; static keeps
  // its fraction but no more than the lease holds.
  EXPECT_EQ(planner.ResidentTarget(P("cpu"), layout, 1), 0u);
  EXPECT_EQ(planner.ResidentTarget(P("interleave:2"), layout, 1), 0u);
  EXPECT_EQ(planner.ResidentTarget(P("static:0.5"), layout, 1), 1u);
  planner.sessions().SetLease(1, Lease(kStaging + 8 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("static:0.5"), layout, 1), 4u);
}

TEST(ResidentTierTest, WithoutALeaseTheFlagDecidesAsBefore) {
  const ShardLayout layout = Uniform(8);
  StepPlanner none(Gpu());
  none.sessions().SetLease(1, GpuLease{}, layout);
  EXPECT_EQ(none.ResidentTarget(P("auto"), layout, 1), 0u);
  StepPlanner flag(Gpu(3 * kSgBytes));
  flag.sessions().SetLease(1, GpuLease{}, layout);
  EXPECT_EQ(flag.ResidentTarget(P("auto"), layout, 1), 3u);
  // An unknown session holds nothing.
  EXPECT_EQ(flag.sessions().ResidentBytes(99), 0u);
}

TEST(ResidentTierTest, SessionsOnOneGpuEachHoldTheirOwnLease) {
  StepPlanner planner(Gpu());
  const ShardLayout layout = Uniform(10);
  planner.sessions().SetLease(1, Lease(kStaging + 2 * kSgBytes), layout);
  planner.sessions().SetLease(2, Lease(kStaging + 5 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 2u);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 2), 5u);
}

// A trainer reports what it likes: a lease far beyond its own state (or the
// GPU) asks for no more than its whole state, so under the cap it cannot
// starve the other sessions of theirs.
TEST(ResidentTierTest, ALeaseBeyondTheSessionsStateAsksForItsStateOnly) {
  StepPlanner planner(Gpu(6 * kSgBytes));
  const ShardLayout small = Uniform(2);
  const ShardLayout large = Uniform(10);
  planner.sessions().SetLease(1, Lease(kStaging + 4 * kSgBytes), large);
  for (uint64_t huge : {uint64_t{1} << 40, ~uint64_t{0}}) {
    planner.sessions().SetLease(2, Lease(huge), small);
    EXPECT_EQ(planner.sessions().ResidentBytes(2), 2 * kSgBytes) << huge;
    EXPECT_EQ(planner.ResidentTarget(P("auto"), small, 2), 2u) << huge;
    // 4 + 2 asked, 6 allowed: session 1 keeps all it asked for.
    EXPECT_EQ(planner.sessions().ResidentBytes(1), 4 * kSgBytes) << huge;
    EXPECT_EQ(planner.ResidentTarget(P("auto"), large, 1), 4u) << huge;
    EXPECT_EQ(planner.sessions().LeaseOf(2).lease_bytes, huge);  // reported as given
  }
  // Changing every step: each report replaces the last, nothing accumulates.
  for (int i = 0; i < 100; ++i) {
    planner.sessions().SetLease(2, Lease(i % 2 == 0 ? ~uint64_t{0} : 0), small);
  }
  EXPECT_EQ(planner.sessions().ResidentBytes(2), 0u);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), large, 1), 4u);
  // No GPU at all (a host engine's planner): nothing resident whatever the lease.
  StepPlanner host{PlannerOptions{}};
  host.sessions().SetLease(3, Lease(~uint64_t{0}), large);
  EXPECT_EQ(host.ResidentTarget(P("auto"), large, 3), 0u);
  EXPECT_EQ(host.ResidentTarget(P("static:1"), large, 3), 0u);
}

TEST(ResidentTierTest, TheFlagCapsAllSessionsTogetherInProportion) {
  StepPlanner planner(Gpu(6 * kSgBytes));
  const ShardLayout layout = Uniform(10);
  planner.sessions().SetLease(1, Lease(kStaging + 4 * kSgBytes), layout);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 4u);  // alone: under the cap
  planner.sessions().SetLease(2, Lease(kStaging + 8 * kSgBytes), layout);
  // 12 asked, 6 allowed: half each asked.
  EXPECT_EQ(planner.sessions().ResidentBytes(1), 2 * kSgBytes);
  EXPECT_EQ(planner.sessions().ResidentBytes(2), 4 * kSgBytes);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 2u);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 2), 4u);
  // A session without a lease asks for the whole cap.
  planner.sessions().SetLease(3, GpuLease{}, layout);
  EXPECT_LE(planner.sessions().ResidentBytes(1) + planner.sessions().ResidentBytes(2) +
                planner.sessions().ResidentBytes(3),
            6 * kSgBytes);
  EXPECT_EQ(planner.sessions().ResidentBytes(3),
            2 * kSgBytes);  // 6 of 18 asked: a third of the cap
  // A session that goes gives its share back.
  planner.sessions().Forget(2);
  planner.sessions().Forget(3);
  EXPECT_EQ(planner.ResidentTarget(P("auto"), layout, 1), 4u);
}

TEST(ResidentTierTest, APlanFollowsWhatTheEngineHolds) {
  StepPlanner planner(Gpu());
  const ShardLayout layout = Uniform(5);
  StepPlan plan = planner.Plan(P("auto"), layout, 2);
  EXPECT_EQ(plan.resident, 2u);
  EXPECT_EQ(plan.shared.size() + plan.gpu_only.size() + plan.cpu_only.size(), 3u);
  EXPECT_EQ(planner.Plan(P("auto"), layout, 9).resident, 5u);  // clamped to the shard
  StepPlanner host(PlannerOptions{});
  EXPECT_EQ(host.Plan(P("auto"), layout, 3).resident, 0u);  // no GPU: nothing resident
}

// The executor over the fake GPU engine, whose resident copies are separate
// "device" memory.
struct ExecutorFixture {
  HostMemoryBudget budget{0};
  std::unique_ptr<ShardState> shard;
  std::vector<float> params, grads;
  std::vector<TensorBinding> bindings;

  explicit ExecutorFixture(uint32_t subgroups) {
    std::vector<TensorDesc> tensors(1);
    tensors[0].numel = subgroups * kSg;
    shard = *ShardState::Create(tensors, {GroupConfig{GroupStepParams{}, true}}, kSg, &budget,
                                "test");
    params.resize(tensors[0].numel);
    grads.resize(tensors[0].numel);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i] = 0.5f + 1e-3f * static_cast<float>(i % 89);
      grads[i] = 1e-2f * static_cast<float>(static_cast<int>(i % 11) - 5);
    }
    bindings.push_back({params.data(), grads.data()});
  }

  static StepRequest Request(const GpuLease* lease = nullptr) {
    StepRequest r{};
    r.num_groups = 1;
    r.grad_scale = 1;
    r.clip_coef = 1;
    r.groups[0] = GroupStepParams{1e-2, 0.9, 0.999, 1e-8, 0.01};
    if (lease != nullptr) {
      r.flags = kStepGpuLease;
      r.gpu_lease_bytes = lease->lease_bytes;
    }
    return r;
  }

  std::vector<float> State() const {
    std::vector<float> all;
    for (int which = 0; which < 3; ++which) {
      std::vector<float> v(shard->tensors()[0].numel);
      shard->ReadTensor(0, which, v.data());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
};

TEST(ResidentTierTest, ALowerLeaseIsGivenBackBeforeTheStepAndTheStateStaysExact) {
  FakeEngine gpu(FakeEngine::Options{.gpu = true});
  FakeEngine host(FakeEngine::Options{.gpu = false});
  StepExecutor dev_ex(&gpu, Gpu());
  StepExecutor ref_ex(&host, PlannerOptions{});
  ExecutorFixture dev(6), ref(6);
  for (ExecutorFixture* f : {&dev, &ref}) {
    StepExecutor& ex = f == &dev ? dev_ex : ref_ex;
    ASSERT_TRUE(ex.ReadWeights(*f->shard, f->bindings, 0).ok());
  }
  const uint64_t leases[] = {5, 5, 2, 6, 0, 3, 1};
  for (uint64_t subgroups : leases) {
    const GpuLease lease = Lease(kStaging + subgroups * kSgBytes);
    const StepRequest req = ExecutorFixture::Request(&lease);
    ASSERT_TRUE(dev_ex.ApplyLease(*dev.shard, req, P("auto"), 1).ok());
    // Given back already: nothing beyond the new lease is held.
    EXPECT_LE(gpu.resident_bytes(), subgroups * kSgBytes);
    absl::StatusOr<StepOutcome> a = dev_ex.Run(*dev.shard, dev.bindings, req, P("auto"), {}, 1);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->resident_subgroups, subgroups);
    EXPECT_EQ(a->gpu_lease_bytes, lease.lease_bytes);
    EXPECT_EQ(a->resident_budget_bytes, subgroups * kSgBytes);
    EXPECT_EQ(gpu.resident_bytes(), subgroups * kSgBytes);
    ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, ExecutorFixture::Request(), P("auto")).ok());
    EXPECT_EQ(dev.params, ref.params);  // the weights, bit for bit
  }
  // The host state of the resident subgroups is poisoned by the fake until
  // it comes home: after a sync every byte equals the all-host run's.
  ASSERT_TRUE(gpu.SyncResidentToHost(*dev.shard).ok());
  EXPECT_EQ(dev.State(), ref.State());
  // A shrink to nothing brings every subgroup home and frees the "device".
  const GpuLease zero = Lease(0);
  ASSERT_TRUE(dev_ex.ApplyLease(*dev.shard, ExecutorFixture::Request(&zero), P("auto"), 1).ok());
  EXPECT_EQ(gpu.resident_bytes(), 0u);
  EXPECT_EQ(dev.State(), ref.State());
}

// The delayed host path beside resident subgroups (static:0.5 within leases
// that move the tier): after each step the trainer holds, bit for bit, the
// all-host reference's weights of that step for the resident subgroups and
// of the step before for the delayed ones, with gradients computed from the
// weights it holds (so a wrong install would show in every later step).
TEST(ResidentTierTest, DelayedSubgroupsBesideResidentOnesAreExactlyOneStepLate) {
  FakeEngine gpu(FakeEngine::Options{.gpu = true});
  FakeEngine host(FakeEngine::Options{.gpu = false});
  StepExecutor dev_ex(&gpu, Gpu());
  StepExecutor ref_ex(&host, PlannerOptions{});
  ExecutorFixture dev(6), ref(6);
  ASSERT_TRUE(dev_ex.ReadWeights(*dev.shard, dev.bindings, 0).ok());
  ASSERT_TRUE(ref_ex.ReadWeights(*ref.shard, ref.bindings, 0).ok());
  auto grads_of = [](const std::vector<float>& w, std::vector<float>* g) {
    for (size_t i = 0; i < w.size(); ++i) {
      (*g)[i] = 1e-2f * std::sin(7.0f * w[i] + 0.01f * static_cast<float>(i % 97));
    }
  };
  DelayedHost delayed(*dev.shard, &dev.budget);
  const StepKind kind(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  std::vector<float> view = ref.params;  // what the trainer should hold
  const uint64_t leases[] = {6, 6, 2, 2, 6, 0, 3, 3, 1, 6};
  for (uint64_t subgroups : leases) {
    grads_of(dev.params, &dev.grads);
    grads_of(view, &ref.grads);
    ASSERT_EQ(dev.grads, ref.grads);
    const GpuLease lease = Lease(kStaging + subgroups * kSgBytes);
    const StepRequest req = ExecutorFixture::Request(&lease);
    ASSERT_TRUE(dev_ex.ApplyLease(*dev.shard, req, P("static:0.5"), 1).ok());
    absl::StatusOr<StepOutcome> a = dev_ex.Run(*dev.shard, dev.bindings, req, kind,
                                               P("static:0.5"), StepSync{}, 1, {}, &delayed);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(dev_ex.UpdateDelayed(*dev.shard, delayed).ok());  // as the session does
    const uint64_t resident = a->resident_subgroups;
    EXPECT_EQ(resident, std::min<uint64_t>(3, subgroups));
    EXPECT_EQ(a->delayed_subgroups, 6 - resident);
    const std::vector<float> before = ref.params;
    ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, ExecutorFixture::Request(), P("cpu")).ok());
    for (size_t i = 0; i < view.size(); ++i) {
      view[i] = i / kSg >= resident ? before[i] : ref.params[i];
    }
    EXPECT_EQ(dev.params, view) << "lease of " << subgroups << " subgroups";
  }
  // The last step's delayed weights come with an install; the state is the
  // reference's, bit for bit.
  ASSERT_TRUE(dev_ex.InstallPending(*dev.shard, dev.bindings, delayed).ok());
  EXPECT_EQ(dev.params, ref.params);
  ASSERT_TRUE(gpu.SyncResidentToHost(*dev.shard).ok());
  EXPECT_EQ(dev.State(), ref.State());
}

TEST(ResidentTierTest, GrowthStopsWhereTheDeviceIsFullAndThePlanFollows) {
  FakeEngine gpu(FakeEngine::Options{.gpu = true, .device_bytes = 2 * kSgBytes});
  StepExecutor ex(&gpu, Gpu());
  ExecutorFixture f(6);
  ASSERT_TRUE(ex.ReadWeights(*f.shard, f.bindings, 0).ok());
  const GpuLease lease = Lease(kStaging + 5 * kSgBytes);
  const StepRequest req = ExecutorFixture::Request(&lease);
  ASSERT_TRUE(ex.ApplyLease(*f.shard, req, P("auto"), 1).ok());
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, req, P("auto"), {}, 1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->resident_subgroups, 2u);
  EXPECT_EQ(gpu.plans().back().resident, 2u);
}

}  // namespace
}  // namespace dos
