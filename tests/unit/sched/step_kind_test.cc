// A step's kind (step_kind.h) from the request's flags, the order the
// planner gives each kind's plan, and the readiness contract of engine.h
// as the fake engine keeps it: a step updated per subgroup reads no
// subgroup's gradients before its wait_ready returned, in the plan's order,
// and stops at the first failed wait; other steps never wait.
#include "daemon/sched/step_kind.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "daemon/sched/step_executor.h"
#include "daemon/sched/step_planner.h"
#include "daemon/state/shard_state.h"
#include "dos/wire/control_block.h"
#include "tests/unit/sched/fake_engine.h"
#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

using Gradients = StepKind::Gradients;
constexpr uint64_t kSg = 1000;  // elements per subgroup

TEST(StepKindTest, DecodesEachKindFromTheRequestsFlags) {
  struct Case {
    uint32_t flags;
    Gradients gradients;
  };
  const Case cases[] = {
      {0, Gradients::kFinal},
      {kStepGradientsChecked | kStepTrainerEventRecorded | kStepGpuLease | kStepSkipTensors,
       Gradients::kFinal},
      {kStepGradientsPending, Gradients::kAtVerdict},
      {kStepGradientsPending | kStepGradientsChecked, Gradients::kAtVerdict},
      {kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked, Gradients::kPerSubgroup},
  };
  for (const Case& c : cases) {
    for (bool stream : {false, true}) {
      absl::StatusOr<StepKind> kind = StepKind::Decode(c.flags, stream);
      ASSERT_TRUE(kind.ok()) << c.flags << ": " << kind.status();
      EXPECT_EQ(*kind, StepKind(c.gradients, stream)) << c.flags;
      EXPECT_EQ(kind->early(), c.gradients != Gradients::kFinal);
      EXPECT_EQ(kind->awaits_verdict(), c.gradients == Gradients::kAtVerdict);
      EXPECT_EQ(kind->per_subgroup(), c.gradients == Gradients::kPerSubgroup);
      EXPECT_EQ(kind->stream_ordered(), stream);
    }
  }
  EXPECT_EQ(StepKind(), StepKind(Gradients::kFinal, false));
  EXPECT_STREQ(StepKind(Gradients::kPerSubgroup, false).name(), "per_subgroup");
}

TEST(StepKindTest, RefusesWhatNoClientMaySend) {
  struct Case {
    uint32_t flags;
    const char* names;  // in the message
  };
  const Case cases[] = {
      {1u << 31, "unknown bits"},
      {~0u, "unknown bits"},
      {kStepAbandon, "kStepAbandon"},
      {kStepGradientsPending | kStepAbandon, "kStepAbandon"},
      {kStepNoVerdict | kStepGradientsChecked, "kStepNoVerdict"},
      {kStepGradientsPending | kStepNoVerdict, "kStepGradientsChecked"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<StepKind> kind = StepKind::Decode(c.flags, false);
    ASSERT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument) << c.flags;
    EXPECT_NE(kind.status().message().find(c.names), absl::string_view::npos) << kind.status();
  }
  EXPECT_TRUE(CheckStepFlags(kStepAbandon, "verdict").ok());
  EXPECT_EQ(CheckStepFlags(1u << 30, "verdict").code(), absl::StatusCode::kInvalidArgument);
}

ShardLayout Uniform(uint32_t n) { return dos::testing::UniformLayout(n, kSg); }

PlannerOptions Gpu(uint64_t resident_bytes = 0) {
  return dos::testing::GpuPlannerOptions(resident_bytes);
}

Policy P(absl::string_view text) { return *ParsePolicy(text); }

const StepKind kSync;
const StepKind kVerdict(Gradients::kAtVerdict, false);
const StepKind kPerSubgroup(Gradients::kPerSubgroup, true);

// Synchronous and verdict steps: resident first, 0 up, lists as placed.
// Per subgroup: the order backward makes gradients final (the last
// subgroups first), the resident ones last; shared keeps its ends.
TEST(StepKindTest, DecodesTheDelay) {
  absl::StatusOr<StepKind> k = StepKind::Decode(kStepDelayHost, true);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_TRUE(k->delays_host());
  EXPECT_FALSE(k->finishes_delayed());
  k = StepKind::Decode(kStepDelayHost | kStepGradientsPending, true);  // a verdict step
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_TRUE(k->delays_host() && k->awaits_verdict());
  k = StepKind::Decode(kStepFinishDelayed | kStepTrainerEventRecorded | kStepGpuLease, true);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_TRUE(k->finishes_delayed());
  EXPECT_FALSE(StepKind::Decode(0, false)->delays_host());
  // Only a verdict says its gradients were rewritten (protocol 8).
  EXPECT_TRUE(CheckStepFlags(kStepGradientsRewritten | kStepDelayHost, "verdict").ok());
  k = StepKind::Decode(kStepDelayHost | kStepGradientsRewritten, true);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("only a verdict"), std::string::npos) << k.status();
  // An early step without a verdict updates during backward already.
  k = StepKind::Decode(kStepDelayHost | kStepGradientsPending | kStepNoVerdict |
                           kStepGradientsChecked, true);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("overlap"), std::string::npos) << k.status();
  // A finish applies nothing: no other kind may come with it.
  EXPECT_EQ(StepKind::Decode(kStepFinishDelayed | kStepDelayHost, true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StepKind::Decode(kStepFinishDelayed | kStepGradientsPending, true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StepKindTest, ADelayedPlanDelaysTheCpuSideWithinTheBudget) {
  StepPlan plan;
  plan.num_subgroups = 6;
  plan.numel = {10, 10, 10, 10, 10, 10};
  plan.gpu_only = {0};
  plan.shared = {1, 2, 3};
  plan.cpu_only = {5, 4};
  StepPlanner::PlaceDelayed(plan, 35);  // room for three subgroups
  EXPECT_EQ(plan.delayed, (std::vector<uint32_t>{5, 4, 3}));
  EXPECT_EQ(plan.delayed_params, 30u);
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{0, 1, 2}));  // the rest to the GPU, in order
  EXPECT_TRUE(plan.cpu_only.empty());
  EXPECT_TRUE(plan.shared.empty());
  StepPlan all;
  all.num_subgroups = 2;
  all.numel = {10, 10};
  all.cpu_only = {0, 1};
  StepPlanner::PlaceDelayed(all, std::numeric_limits<double>::infinity());
  EXPECT_EQ(all.delayed, (std::vector<uint32_t>{0, 1}));
  EXPECT_TRUE(all.gpu_only.empty());
}

// --delayed_update_start=result: the update has only the window (not the
// rest of the step's GPU path beside it), so the planner gives the host
// path no more than when it starts at the capture, and all of it when the
// window is long.
TEST(StepKindTest, AnUpdateStartedAtTheResultHasOnlyTheWindow) {
  PlannerOptions at_result = Gpu();
  at_result.delayed_start_at_result = true;
  StepPlanner captured(Gpu()), result(at_result);
  const StepKind delay(Gradients::kFinal, true, StepKind::Delay::kHost);
  for (double window_us : {1.0, 10.0, 100.0, 1e3}) {
    const StepPlan a = captured.Plan(P("auto"), Uniform(20), 0, delay, window_us);
    const StepPlan b = result.Plan(P("auto"), Uniform(20), 0, delay, window_us);
    EXPECT_LE(b.delayed_params, a.delayed_params) << window_us;
    EXPECT_GE(b.predicted_iter_us, window_us) << window_us;
  }
  const StepPlan a = captured.Plan(P("auto"), Uniform(20), 0, delay, 1e9);
  const StepPlan b = result.Plan(P("auto"), Uniform(20), 0, delay, 1e9);
  EXPECT_EQ(b.delayed, a.delayed);
  EXPECT_GT(b.delayed_params, 0u);
}

// Under auto a delayed step pins no streamed subgroup to the GPU path: with
// a window long enough for the CPU, every subgroup that is not resident is
// delayed (on nvidia-h200 three streamed subgroups of a 7B compact job kept
// 48 ms of PCIe in the step while the CPU had time for them).
TEST(StepKindTest, ALongWindowDelaysEveryStreamedSubgroup) {
  StepPlanner planner(Gpu());
  const StepKind delay(Gradients::kFinal, true, StepKind::Delay::kHost);
  const StepPlan exact = planner.Plan(P("auto"), Uniform(20), 2, kSync);
  ASSERT_FALSE(exact.gpu_only.empty());  // the exact step pins a share to the GPU
  const StepPlan plan = planner.Plan(P("auto"), Uniform(20), 2, delay, 1e12);
  EXPECT_EQ(plan.delayed.size(), 18u);
  EXPECT_TRUE(plan.gpu_only.empty());
  EXPECT_EQ(plan.resident, 2u);
  const StepPlan none = planner.Plan(P("auto"), Uniform(20), 2, delay, 1e-3);
  EXPECT_EQ(none.delayed.size() + none.gpu_only.size(), 18u);  // what is not delayed streams
}

// --delayed_gpu_path: what the CPU's window cannot hold is delayed too and
// streamed during the window, as much as its PCIe time holds (on
// nvidia-h200 at 6B about 0.5B parameters crossed PCIe in the step after
// backward with only the host path delayed); other policies delay every
// streamed subgroup.
TEST(StepKindTest, TheDelayedGpuPathTakesWhatTheWindowsPcieHolds) {
  PlannerOptions on = Gpu();
  on.delayed_gpu = true;
  StepPlanner cpu_only(Gpu()), both(on);
  const StepKind delay(Gradients::kFinal, true, StepKind::Delay::kHost);
  const ShardLayout layout = dos::testing::UniformLayout(20, 100'000'000);
  const double window_us = 100'000;  // 0.1 s
  const StepPlan a = cpu_only.Plan(P("auto"), layout, 2, delay, window_us);
  const StepPlan b = both.Plan(P("auto"), layout, 2, delay, window_us);
  EXPECT_TRUE(a.delayed_gpu.empty());
  ASSERT_FALSE(a.gpu_only.empty());
  ASSERT_FALSE(b.delayed_gpu.empty());
  ASSERT_FALSE(b.gpu_only.empty());  // 1.6B parameters: more than 0.1 s of PCIe
  EXPECT_EQ(b.delayed.size() - b.delayed_gpu.size(), a.delayed.size());  // the CPU's share
  EXPECT_EQ(b.delayed.size() + b.gpu_only.size(), 18u);
  for (uint32_t sg : b.delayed_gpu) {
    EXPECT_NE(std::find(b.delayed.begin(), b.delayed.end(), sg), b.delayed.end()) << sg;
    EXPECT_EQ(std::find(b.gpu_only.begin(), b.gpu_only.end(), sg), b.gpu_only.end()) << sg;
  }
  EXPECT_EQ(b.delayed_gpu_params, b.delayed_gpu.size() * 100'000'000u);
  EXPECT_EQ(b.delayed_params, b.delayed.size() * 100'000'000u);
  // Their state and gradients in, state and weights out: 14 bytes a
  // parameter each way at 55 GB/s within 90% of the window (less where the
  // CPU's update shares host memory with them); a longer window holds more.
  EXPECT_LE(b.delayed_gpu_params * 14 / 55e9, 0.9 * window_us * 1e-6);
  EXPECT_GT(both.Plan(P("auto"), layout, 2, delay, 2 * window_us).delayed_gpu_params,
            b.delayed_gpu_params);
  EXPECT_LT(b.predicted_us, a.predicted_us);
  // Without a window (the first delayed plans) nothing is delayed on the GPU.
  EXPECT_TRUE(both.Plan(P("auto"), layout, 2, delay, 1e-3).delayed_gpu.empty());
  // By rule: every streamed subgroup, after the CPU's.
  const StepPlan rule = both.Plan(P("interleave:2"), Uniform(7), 2, delay);
  EXPECT_EQ(rule.delayed, (std::vector<uint32_t>{3, 5, 2, 4, 6}));
  EXPECT_EQ(rule.delayed_gpu, (std::vector<uint32_t>{2, 4, 6}));
  EXPECT_TRUE(rule.gpu_only.empty());
}

// The GPU's delayed update holds the engine's staging slots through the
// window: with a second session on the engine none is placed there
// (its steps would wait), and once that session is gone (or its trainer
// died) they are again.
TEST(StepKindTest, TheDelayedGpuPathIsForASessionAloneOnItsEngine) {
  PlannerOptions on = Gpu();
  on.delayed_gpu = true;
  StepPlanner planner(on);
  const StepKind delay(Gradients::kFinal, true, StepKind::Delay::kHost);
  const ShardLayout layout = dos::testing::UniformLayout(20, 100'000'000);
  const double window_us = 100'000;
  planner.sessions().SetLease(1, GpuLease{}, layout);
  const StepPlan alone = planner.Plan(P("auto"), layout, 2, delay, window_us);
  ASSERT_FALSE(alone.delayed_gpu.empty());
  planner.sessions().SetLease(2, GpuLease{}, layout);
  const StepPlan shared = planner.Plan(P("auto"), layout, 2, delay, window_us);
  EXPECT_TRUE(shared.delayed_gpu.empty());
  EXPECT_EQ(shared.delayed_gpu_params, 0u);
  EXPECT_EQ(shared.delayed.size() + shared.gpu_only.size(), 18u);  // the rest streams
  planner.sessions().Forget(2);
  EXPECT_EQ(planner.Plan(P("auto"), layout, 2, delay, window_us).delayed_gpu, alone.delayed_gpu);
  // A second session bound to the engine that reports no lease (a C client)
  // counts too.
  planner.sessions().Bind(1);
  planner.sessions().Bind(3);
  EXPECT_TRUE(planner.Plan(P("auto"), layout, 2, delay, window_us).delayed_gpu.empty());
  planner.sessions().Forget(3);
  EXPECT_EQ(planner.Plan(P("auto"), layout, 2, delay, window_us).delayed_gpu, alone.delayed_gpu);
  // One whose trainer died (kept for a resume, its lease's share included)
  // takes no turns: the session is alone again.
  planner.sessions().SetLease(2, GpuLease{}, layout);
  planner.sessions().Bind(2);
  EXPECT_TRUE(planner.Plan(P("auto"), layout, 2, delay, window_us).delayed_gpu.empty());
  planner.sessions().Unbind(2);
  EXPECT_EQ(planner.Plan(P("auto"), layout, 2, delay, window_us).delayed_gpu, alone.delayed_gpu);
}

// --delayed_gpu_first: the GPU takes the CPU's delayed subgroups too, last
// first, while the window's PCIe holds them; the CPU keeps the rest. With a
// window long enough for its PCIe nothing is left on the CPU.
TEST(StepKindTest, TheDelayedGpuFirstTakesTheCpusSubgroupsWhileThePcieHolds) {
  PlannerOptions on = Gpu(), first = Gpu();
  on.delayed_gpu = true;
  first.delayed_gpu = first.delayed_gpu_first = true;
  StepPlanner streamed_only(on), gpu_first(first);
  const StepKind delay(Gradients::kFinal, true, StepKind::Delay::kHost);
  const ShardLayout layout = dos::testing::UniformLayout(20, 100'000'000);
  for (double window_us : {100'000.0, 300'000.0}) {
    const StepPlan a = streamed_only.Plan(P("auto"), layout, 2, delay, window_us);
    const StepPlan b = gpu_first.Plan(P("auto"), layout, 2, delay, window_us);
    EXPECT_GE(b.delayed_gpu_params, a.delayed_gpu_params) << window_us;
    EXPECT_LE(b.delayed_params - b.delayed_gpu_params, a.delayed_params - a.delayed_gpu_params)
        << window_us;
    EXPECT_LE(b.delayed_gpu_params * 14 / 55e9, 0.9 * window_us * 1e-6) << window_us;
    uint64_t params = 0;
    for (uint32_t sg : b.delayed) params += b.numel[sg];
    EXPECT_EQ(params, b.delayed_params) << window_us;
    EXPECT_EQ(b.delayed.size() + b.gpu_only.size(), 18u) << window_us;
    for (uint32_t sg : b.delayed_gpu) {
      EXPECT_EQ(std::count(b.delayed.begin(), b.delayed.end(), sg), 1) << sg;
    }
  }
  // A window whose PCIe holds every streamed subgroup: the GPU takes the
  // CPU's too, from the back of its list.
  const StepPlan a = streamed_only.Plan(P("auto"), layout, 2, delay, 1e7);
  const StepPlan b = gpu_first.Plan(P("auto"), layout, 2, delay, 1e7);
  ASSERT_FALSE(a.delayed.empty());
  EXPECT_EQ(b.delayed_gpu.size(), 18u);
  EXPECT_EQ(b.delayed_gpu_params, b.delayed_params);
  // By rule: all of them on the GPU.
  const StepPlan rule = gpu_first.Plan(P("interleave:2"), Uniform(7), 2, delay);
  EXPECT_EQ(rule.delayed, (std::vector<uint32_t>{2, 4, 6, 5, 3}));
  EXPECT_EQ(rule.delayed_gpu, rule.delayed);
  EXPECT_TRUE(rule.gpu_only.empty());
}

TEST(StepKindTest, ThePlannerOrdersAPerSubgroupStepByReadiness) {
  StepPlanner planner(Gpu());
  for (StepKind kind : {kSync, kVerdict}) {
    const StepPlan plan = planner.Plan(P("interleave:2"), Uniform(7), 2, kind);
    EXPECT_FALSE(plan.wait_ready);
    EXPECT_TRUE(plan.resident_first);
    EXPECT_EQ(plan.resident_order, (std::vector<uint32_t>{0, 1}));
    EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{2, 4, 6}));
    EXPECT_EQ(plan.cpu_only, (std::vector<uint32_t>{3, 5}));
  }
  const StepPlan plan = planner.Plan(P("interleave:2"), Uniform(7), 2, kPerSubgroup);
  EXPECT_TRUE(plan.wait_ready);
  EXPECT_FALSE(plan.resident_first);
  EXPECT_EQ(plan.resident_order, (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(plan.gpu_only, (std::vector<uint32_t>{6, 4, 2}));
  EXPECT_EQ(plan.cpu_only, (std::vector<uint32_t>{5, 3}));

  const StepPlan sync_auto = planner.Plan(P("auto"), Uniform(20), 0, kSync);
  const StepPlan early_auto = planner.Plan(P("auto"), Uniform(20), 0, kPerSubgroup);
  ASSERT_FALSE(sync_auto.gpu_only.empty());
  ASSERT_FALSE(sync_auto.cpu_only.empty());
  EXPECT_EQ(early_auto.gpu_only,
            std::vector<uint32_t>(sync_auto.gpu_only.rbegin(), sync_auto.gpu_only.rend()));
  EXPECT_EQ(early_auto.cpu_only,
            std::vector<uint32_t>(sync_auto.cpu_only.rbegin(), sync_auto.cpu_only.rend()));
  EXPECT_EQ(early_auto.shared, sync_auto.shared);

  StepPlanner host{PlannerOptions{}};
  EXPECT_EQ(host.Plan(P("auto"), Uniform(4), 0, kPerSubgroup).cpu_only,
            (std::vector<uint32_t>{3, 2, 1, 0}));
}

// One tensor of `n` subgroups whose gradients start as NaN: only the
// trainer's "backward" (Produce) makes a subgroup's real.
struct Trainer {
  HostMemoryBudget budget{0};
  std::unique_ptr<ShardState> shard;
  std::vector<float> params, grads;
  std::vector<TensorBinding> bindings;

  explicit Trainer(uint32_t n, bool produced) {
    std::vector<TensorDesc> tensors(1);
    tensors[0].numel = n * kSg;
    shard = *ShardState::Create(tensors, {GroupConfig{GroupStepParams{}, true}}, kSg, &budget,
                                "test");
    params.resize(tensors[0].numel);
    grads.assign(tensors[0].numel, std::numeric_limits<float>::quiet_NaN());
    for (size_t i = 0; i < params.size(); ++i) {
      params[i] = 0.5f + 1e-3f * static_cast<float>(i % 89);
    }
    bindings.push_back({params.data(), grads.data()});
    for (uint32_t sg = 0; produced && sg < n; ++sg) Produce(sg);
  }
  void Produce(uint32_t sg) {
    for (uint64_t i = sg * kSg; i < (sg + 1) * kSg; ++i) {
      grads[i] = 1e-2f * static_cast<float>(static_cast<int>(i % 11) - 5);
    }
  }
  std::vector<float> State(Engine& engine) const {
    EXPECT_TRUE(engine.SyncResidentToHost(*shard).ok());
    std::vector<float> all;
    for (int which = 0; which < 3; ++which) {
      std::vector<float> v(shard->tensors()[0].numel);
      shard->ReadTensor(0, which, v.data());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  static StepRequest Request(uint32_t flags) {
    StepRequest r{};
    r.num_groups = 1;
    r.grad_scale = 1;
    r.clip_coef = 1;
    r.groups[0] = GroupStepParams{1e-2, 0.9, 0.999, 1e-8, 0.01};
    r.flags = flags;
    return r;
  }
};

constexpr uint32_t kPerSubgroupFlags = kStepGradientsPending | kStepNoVerdict |
                                       kStepGradientsChecked;

// A fake GPU engine with two resident subgroups of six under auto, and the
// same step on the fake's host path with every gradient final first: the
// early step must wait for each subgroup's gradients (they are NaN until
// then) and end bit for bit where the synchronous one does.
TEST(StepKindTest, TheFakeEngineReadsNoGradientsBeforeTheyAreReady) {
  FakeEngine ref_engine(FakeEngine::Options{.gpu = false});
  StepExecutor ref_ex(&ref_engine);
  Trainer ref(6, /*produced=*/true);
  ASSERT_TRUE(ref_ex.ReadWeights(*ref.shard, ref.bindings, 0).ok());
  ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, Trainer::Request(0), P("auto")).ok());

  FakeEngine engine(FakeEngine::Options{.gpu = true});
  StepExecutor ex(&engine, Gpu(2 * kSg * 12));
  Trainer t(6, /*produced=*/false);
  ASSERT_TRUE(ex.ReadWeights(*t.shard, t.bindings, 0).ok());
  const StepRequest r = Trainer::Request(kPerSubgroupFlags);
  std::vector<uint32_t> waited;
  StepSync sync;
  sync.wait_ready = [&](uint32_t sg) {
    waited.push_back(sg);
    t.Produce(sg);  // backward finished this subgroup just now
    return absl::OkStatus();
  };
  sync.is_ready = [&](uint32_t sg) {
    return std::find(waited.begin(), waited.end(), sg) != waited.end();
  };
  const StepKind kind = *StepKind::Decode(r.flags, false);
  absl::StatusOr<StepOutcome> out = ex.Run(*t.shard, t.bindings, r, kind, P("auto"), sync, 0, {});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->early);
  EXPECT_EQ(out->resident_subgroups, 2u);
  // Every subgroup waited for once, updated right after, in the plan's order.
  const StepPlan plan = engine.plans().back();
  EXPECT_TRUE(plan.wait_ready);
  ASSERT_EQ(waited.size(), 6u);
  EXPECT_EQ(waited, engine.done_subgroups());
  EXPECT_EQ(std::vector<uint32_t>(waited.end() - 2, waited.end()), (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(t.params, ref.params);
  EXPECT_EQ(t.State(engine), ref.State(ref_engine));
}

TEST(StepKindTest, AFailedWaitEndsTheFakeEnginesStepThere) {
  FakeEngine engine(FakeEngine::Options{.gpu = true});
  StepExecutor ex(&engine, Gpu());
  Trainer t(4, /*produced=*/true);
  ASSERT_TRUE(ex.ReadWeights(*t.shard, t.bindings, 0).ok());
  const std::vector<float> before = t.params;
  StepSync sync;
  int waits = 0;
  sync.wait_ready = [&](uint32_t) {
    return ++waits < 3 ? absl::OkStatus() : absl::UnavailableError("trainer gone");
  };
  sync.is_ready = [](uint32_t) { return false; };
  const StepRequest r = Trainer::Request(kPerSubgroupFlags);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*t.shard, t.bindings, r, kPerSubgroup, P("interleave:2"), sync, 0, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
  EXPECT_EQ(engine.done_subgroups().size(), 2u);  // the two waited for, nothing after
  EXPECT_EQ(t.shard->tensors()[0].step, 0);
  // The subgroups not reached keep the trainer's weights.
  size_t unchanged = 0;
  for (size_t i = 0; i < before.size(); ++i) unchanged += t.params[i] == before[i];
  EXPECT_GE(unchanged, 2 * kSg);
}

TEST(StepKindTest, StepsWhoseGradientsAreFinalNeverWait) {
  for (StepKind kind : {kSync, kVerdict}) {
    FakeEngine engine(FakeEngine::Options{.gpu = true});
    StepExecutor ex(&engine, Gpu(kSg * 12));
    Trainer t(3, /*produced=*/true);
    ASSERT_TRUE(ex.ReadWeights(*t.shard, t.bindings, 0).ok());
    StepSync sync;
    sync.wait_ready = [](uint32_t) -> absl::Status {
      ADD_FAILURE() << "wait_ready called for a step whose gradients are final";
      return absl::InternalError("waited");
    };
    sync.is_ready = [](uint32_t) {
      ADD_FAILURE() << "is_ready called for a step whose gradients are final";
      return false;
    };
    const StepRequest r = Trainer::Request(kind.early() ? uint32_t{kStepGradientsPending} : 0u);
    AwaitVerdict verdict = [] { return absl::StatusOr<StepRequest>(Trainer::Request(0)); };
    absl::StatusOr<StepOutcome> out =
        ex.Run(*t.shard, t.bindings, r, kind, P("auto"), sync, 0, verdict);
    ASSERT_TRUE(out.ok()) << kind.name() << ": " << out.status();
    EXPECT_FALSE(engine.plans().back().wait_ready);
    EXPECT_EQ(engine.done_subgroups(), (std::vector<uint32_t>{0, 1, 2}));
  }
}

}  // namespace
}  // namespace dos
