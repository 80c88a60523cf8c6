// StepExecutor on the host path (no GPU): a step against the double
// reference, skipped steps, the flags and refusals, copy-on-write snapshots
// during a step, and the weight conversions at registration.
#include "daemon/sched/step_executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/cpu/adam_reference.h"
#include "daemon/cpu/host_engine.h"
#include "tests/unit/sched/fake_engine.h"

namespace dos {
namespace {

constexpr uint64_t kSubgroup = 1000;

// Two fp32 tensors (3001 and 1500 elements: subgroups cross the boundary)
// whose trainer memory is plain host vectors.
struct Fixture {
  HostMemoryBudget budget{0};
  cpu::CpuUpdater cpu{cpu::CpuUpdaterOptions{.threads = 2}};
  cpu::HostEngine engine{&cpu};
  std::unique_ptr<ShardState> shard;
  std::vector<std::vector<float>> params, grads;
  std::vector<TensorBinding> bindings;

  Fixture() {
    std::vector<TensorDesc> tensors(2);
    tensors[0].numel = 3001;
    tensors[1].numel = 1500;
    shard = *ShardState::Create(tensors, {GroupConfig{}}, kSubgroup, &budget, "test");
    for (const TensorDesc& t : shard->tensors()) {
      params.emplace_back(t.numel);
      grads.emplace_back(t.numel);
      for (uint64_t i = 0; i < t.numel; ++i) {
        params.back()[i] = 0.5f + 1e-3f * static_cast<float>(i % 97);
        grads.back()[i] = 1e-2f * static_cast<float>(static_cast<int>(i % 13) - 6);
      }
    }
    for (size_t t = 0; t < params.size(); ++t) {
      bindings.push_back({params[t].data(), grads[t].data()});
    }
    StepExecutor ex(&engine);
    for (uint32_t t = 0; t < 2; ++t) EXPECT_TRUE(ex.ReadWeights(*shard, bindings, t).ok());
  }

  static StepRequest Request() {
    StepRequest r{};
    r.num_groups = 1;
    r.grad_scale = 1;
    r.clip_coef = 1;
    r.groups[0] = GroupStepParams{1e-2, 0.9, 0.999, 1e-8, 0.01};
    return r;
  }

  std::vector<float> Master(uint32_t t) const {
    std::vector<float> v(shard->tensors()[t].numel);
    shard->ReadTensor(t, 0, v.data());
    return v;
  }
};

TEST(StepExecutorTest, AHostStepMatchesTheDoubleReference) {
  Fixture f;
  StepExecutor ex(&f.engine);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), Policy{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->found_inf);
  EXPECT_EQ(out->step, 1);
  EXPECT_EQ(out->cpu_subgroups, 5u);
  for (uint32_t t = 0; t < 2; ++t) {
    const uint64_t n = f.shard->tensors()[t].numel;
    std::vector<float> p0(n), m0(n, 0), v0(n, 0);
    for (uint64_t i = 0; i < n; ++i) p0[i] = 0.5f + 1e-3f * static_cast<float>(i % 97);
    cpu::AdamSpan span{f.grads[t].data(), DType::kF32, p0.data(), m0.data(), v0.data(),
                       nullptr, DType::kF32, n};
    std::vector<cpu::ReferenceElement> ref(n);
    cpu::AdamReference({Fixture::Request().groups[0], true, 1, 1, 1}, span, ref.data());
    std::vector<float> got = f.Master(t);
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got[i], ref[i].p.value, 8 * 0x1p-24 * ref[i].p.magnitude + 1e-30) << t << " " << i;
      ASSERT_EQ(f.params[t][i], got[i]);  // the trainer's fp32 weights are the masters
    }
  }
}

TEST(StepExecutorTest, NonFiniteGradientsSkipTheStepAndKeepTheCounters) {
  Fixture f;
  f.grads[1][77] = std::numeric_limits<float>::infinity();
  const std::vector<float> before = f.Master(0);
  StepExecutor ex(&f.engine);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), Policy{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->found_inf);
  EXPECT_EQ(out->step, 0);
  EXPECT_EQ(f.shard->tensors()[1].step, 0);
  EXPECT_EQ(f.Master(0), before);
}

TEST(StepExecutorTest, GradientsCheckedByTheClientAreNotScannedAgain) {
  Fixture f;
  f.grads[0][5] = std::numeric_limits<float>::quiet_NaN();
  StepRequest r = Fixture::Request();
  r.flags = kStepGradientsChecked;
  StepExecutor ex(&f.engine);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, r, Policy{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->found_inf);
  EXPECT_EQ(out->step, 1);
  EXPECT_TRUE(std::isnan(f.Master(0)[5]));
}

// kStepSkipTensors: a tensor without a gradient (torch's grad None) keeps
// its master, moments, trainer weight and step count; the others step as
// usual, and the skipped one's next step is its first (bias correction 1).
TEST(StepExecutorTest, ASkippedTensorKeepsItsStateAndStepCount) {
  Fixture f;
  Fixture g;  // the same step without tensor 1, for tensor 0's result
  StepExecutor ex(&f.engine);
  StepExecutor gx(&g.engine);
  ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), Policy{}).ok());
  ASSERT_TRUE(gx.Run(*g.shard, g.bindings, Fixture::Request(), Policy{}).ok());
  const std::vector<float> master1 = f.Master(1);
  const std::vector<float> weights1 = f.params[1];
  std::vector<float> m1(1500), v1(1500);
  f.shard->ReadTensor(1, 1, m1.data());
  f.shard->ReadTensor(1, 2, v1.data());
  StepRequest r = Fixture::Request();
  r.flags |= kStepSkipTensors;
  r.skip[0] = uint64_t{1} << 1;
  f.grads[1].assign(1500, 0.0f);  // a zeroed gradient buffer, as the client leaves it
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, r, Policy{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->step, 2);
  EXPECT_EQ(f.shard->tensors()[0].step, 2);
  EXPECT_EQ(f.shard->tensors()[1].step, 1);
  std::vector<float> m(1500), v(1500);
  f.shard->ReadTensor(1, 1, m.data());
  f.shard->ReadTensor(1, 2, v.data());
  EXPECT_EQ(f.Master(1), master1);
  EXPECT_EQ(f.params[1], weights1);
  EXPECT_EQ(m, m1);
  EXPECT_EQ(v, v1);
  ASSERT_TRUE(gx.Run(*g.shard, g.bindings, Fixture::Request(), Policy{}).ok());
  EXPECT_EQ(f.Master(0), g.Master(0));  // tensor 0 stepped as without the mask
}

TEST(StepExecutorTest, ATrainerEventFlagWithoutAnEventIsRefused) {
  Fixture f;
  StepRequest r = Fixture::Request();
  r.flags = kStepTrainerEventRecorded;
  StepExecutor ex(&f.engine);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, r, Policy{});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_EQ(f.shard->tensors()[0].step, 0);
}

// The trainer's event is waited for on the host before the scan, and before
// any of the engine's streams is made to wait for it: gradients the trainer
// checked need no scan, and then only a session that shares the engine with
// another waits on the host (the streams serve every session on the GPU:
// another session's step goes on meanwhile).
TEST(StepExecutorTest, TheTrainersEventIsWaitedForOnTheHostBeforeTheEnginesStreams) {
  for (const auto& [checked, shared] : {std::pair{false, false}, std::pair{true, false},
                                        std::pair{false, true}, std::pair{true, true}}) {
    Fixture f;
    FakeEngine events(FakeEngine::Options{.gpu = true});
    StepExecutor ex(&events);
    ex.BindSession(1);
    if (shared) ex.BindSession(2);
    StepSync sync;
    sync.trainer_event = *events.OpenTrainerEvent("trainer");
    StepRequest r = Fixture::Request();
    r.flags = kStepTrainerEventRecorded | (checked ? kStepGradientsChecked : 0u);
    absl::StatusOr<StepOutcome> out =
        ex.Run(*f.shard, f.bindings, r, Policy{.kind = Policy::Kind::kCpu}, sync, 1);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->step, 1);
    EXPECT_EQ(events.waits(), checked ? (shared ? "ew" : "w") : "ews") << checked << shared;
  }
}

TEST(StepExecutorTest, InvalidHyperparametersLeaveTheStateUntouched) {
  Fixture f;
  const std::vector<float> before = f.Master(1);
  StepRequest r = Fixture::Request();
  r.groups[0].lr = -1;
  StepExecutor ex(&f.engine);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, r, Policy{});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("lr"), absl::string_view::npos) << out.status();
  EXPECT_EQ(f.Master(1), before);
  r = Fixture::Request();
  r.num_groups = 2;
  EXPECT_EQ(ex.Run(*f.shard, f.bindings, r, Policy{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StepExecutorTest, EveryPolicyRunsOnTheHostPathAlike) {
  std::vector<float> first;
  for (const char* policy : {"cpu", "static:0.5", "interleave:2", "auto"}) {
    Fixture f;
    StepExecutor ex(&f.engine);
    for (int s = 0; s < 3; ++s) {
      ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), *ParsePolicy(policy)).ok());
    }
    if (first.empty()) first = f.Master(1);
    EXPECT_EQ(f.Master(1), first) << policy;
  }
}

// With room in the pool (the step copies what it writes) and with none
// (the step waits for the writer), the writer reads the boundary's state.
TEST(StepExecutorTest, AStepDuringASnapshotLeavesTheWriterTheBoundary) {
  for (uint64_t limit : {uint64_t{0}, uint64_t{1} << 30}) {
    Fixture f;
    Fixture plain;
    SnapshotPool pool(limit, nullptr, [](uint64_t) { return true; });
    const std::vector<float> boundary = f.Master(0);
    f.shard->BeginSnapshot(&pool);
    StepExecutor ex(&f.engine);
    std::thread step(
        [&] { ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), Policy{}).ok()); });
    std::vector<float> snap(boundary.size());
    const Subgroup* first = f.shard->subgroups().data();
    f.shard->ForEachRun(0, [&](const Subgroup& g, const SubgroupSegment& seg) {
      const Subgroup& v = f.shard->SnapshotAcquire(static_cast<uint32_t>(&g - first));
      std::copy_n(v.master + seg.subgroup_offset, seg.count, snap.data() + seg.tensor_offset);
    });
    f.shard->EndSnapshot();
    step.join();
    ASSERT_TRUE(ex.Run(*plain.shard, plain.bindings, Fixture::Request(), Policy{}).ok());
    EXPECT_EQ(snap, boundary) << limit;
    EXPECT_EQ(f.Master(0), plain.Master(0)) << limit;
  }
}

// A step meeting a writer that holds the first subgroup copies every other
// one ahead of the file (the staging pool has room) instead of trailing the
// writer subgroup by subgroup; the file is still the boundary.
TEST(StepExecutorTest, AStepDuringASnapshotCopiesWhatTheFileHasNotReached) {
  Fixture f;
  SnapshotPool pool(uint64_t{1} << 30, nullptr, [](uint64_t) { return true; });
  const std::vector<float> boundary = f.Master(0);
  const auto n = static_cast<uint32_t>(f.shard->subgroups().size());
  ASSERT_GE(n, 3u);
  uint64_t rest = 0;
  for (uint32_t i = 1; i < n; ++i) rest += f.shard->subgroups()[i].state_bytes();
  f.shard->BeginSnapshot(&pool);
  (void)f.shard->SnapshotAcquire(0);  // the writer is at the first subgroup
  StepExecutor ex(&f.engine);
  std::thread step(
      [&] { ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), Policy{}).ok()); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (pool.used() < rest && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(pool.used(), rest) << "the step did not copy the subgroups ahead of the writer";
  std::vector<float> snap(boundary.size());
  const Subgroup* first = f.shard->subgroups().data();
  f.shard->ForEachRun(0, [&](const Subgroup& g, const SubgroupSegment& seg) {
    const Subgroup& v = f.shard->SnapshotAcquire(static_cast<uint32_t>(&g - first));
    std::copy_n(v.master + seg.subgroup_offset, seg.count, snap.data() + seg.tensor_offset);
  });
  EXPECT_EQ(f.shard->EndSnapshot(), n - 1);
  step.join();
  EXPECT_EQ(snap, boundary);
  EXPECT_EQ(pool.used(), 0u);
}

TEST(StepExecutorTest, WeightsRoundTripThroughBf16) {
  HostMemoryBudget budget{0};
  cpu::CpuUpdater cpu{cpu::CpuUpdaterOptions{.threads = 1}};
  std::vector<TensorDesc> tensors(1);
  tensors[0].numel = 10;
  tensors[0].param_dtype = DType::kBF16;
  tensors[0].grad_dtype = DType::kBF16;
  auto shard = *ShardState::Create(tensors, {GroupConfig{}}, 4, &budget, "t");
  std::vector<uint16_t> param(10), grad(10);
  for (int i = 0; i < 10; ++i) param[i] = FloatToBF16(0.25f * static_cast<float>(i) - 1.0f);
  std::vector<TensorBinding> b = {{param.data(), grad.data()}};
  cpu::HostEngine engine(&cpu);
  StepExecutor ex(&engine);
  ASSERT_TRUE(ex.ReadWeights(*shard, b, 0).ok());
  std::vector<float> master(10);
  shard->ReadTensor(0, 0, master.data());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(master[i], 0.25f * static_cast<float>(i) - 1.0f);
  master[3] = 1.00390625f;  // needs rounding to nearest even in bf16: 1.0
  shard->WriteTensor(0, 0, master.data());
  std::fill(param.begin(), param.end(), 0);
  ASSERT_TRUE(ex.WriteWeights(*shard, b, 0).ok());
  EXPECT_EQ(BF16ToFloat(param[3]), 1.0f);
  EXPECT_EQ(BF16ToFloat(param[9]), 1.25f);
}

}  // namespace
}  // namespace dos

namespace dos {
namespace {

// The delayed update joined, then its weights installed: the state and the
// trainer's weights are the exact steps'.
void FinishAndMatch(StepExecutor& ex, Fixture& f, DelayedHost& delayed, const Fixture& exact) {
  ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << t;
  ASSERT_TRUE(ex.InstallPending(*f.shard, f.bindings, delayed).ok());
  EXPECT_EQ(f.params, exact.params);
}

// The one hyperparameter check (dos/wire/hparams.h) as every step applies
// it: torch's rules, eps = 0 included.
// The delayed host path (delayed_host.h): a delayed step captures the
// gradients and applies nothing; the update after the result makes the
// state the exact step's and leaves the weights pending; the next request
// installs them.
TEST(StepExecutorTest, ADelayedStepIsTheExactStepAppliedLate) {
  Fixture f, exact;
  StepExecutor ex(&f.engine), ex_exact(&exact.engine);
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  const std::vector<std::vector<float>> weights0 = f.params;
  DelayedHost delayed(*f.shard, &f.budget);
  const StepKind kind(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), kind,
                                           Policy{}, StepSync{}, 0, {}, &delayed);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->step, 1);
  EXPECT_EQ(out->delayed_subgroups, 5u);
  EXPECT_EQ(out->delayed_params, 4501u);
  // Nothing in the trainer's memory before the result (the update itself
  // may be running already, on the executor's worker).
  EXPECT_EQ(f.params, weights0);
  for (std::vector<float>& g : f.grads) std::fill(g.begin(), g.end(), 1e3f);  // captured already
  ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
  EXPECT_EQ(delayed.pending().size(), 5u);
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << t;
  EXPECT_EQ(f.params, weights0);     // the weights wait for the next request
  ASSERT_TRUE(ex.InstallPending(*f.shard, f.bindings, delayed).ok());
  EXPECT_EQ(f.params, exact.params);
  EXPECT_TRUE(delayed.pending().empty());
}

// --delayed_update_start=result: the step only captures; the update runs
// when the session asks for it after the result, with the same outcome.
TEST(StepExecutorTest, ADelayedUpdateStartedAtTheResultWaitsForTheSession) {
  Fixture f, exact;
  PlannerOptions at_result;
  at_result.delayed_start_at_result = true;
  StepExecutor ex(&f.engine, at_result), ex_exact(&exact.engine);
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  const std::vector<float> master0 = f.Master(1);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepKind kind(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, StepSync{}, 0, {},
                     &delayed)
                  .ok());
  EXPECT_FALSE(delayed.worker.joinable());  // nothing started beside the step
  EXPECT_EQ(f.Master(1), master0);
  EXPECT_EQ(delayed.captured().size(), 5u);
  FinishAndMatch(ex, f, delayed, exact);
}

// An engine that starts the delayed update before its copies are in
// (GpuEngine::CaptureLoop; the FakeEngine's pipelined_captures, which copies
// a millisecond a subgroup): each subgroup of the update waits for its own
// capture and install, so that two delayed steps in a row install the first
// step's weights (not the second's the update writes into the same buffers)
// and leave the exact steps' state.
TEST(StepExecutorTest, AnUpdateStartedBeforeItsCopiesWaitsForEachSubgroups) {
  Fixture f, exact;
  FakeEngine engine(FakeEngine::Options{.pipelined_captures = true});
  StepExecutor ex(&engine), ex_exact(&exact.engine);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepKind kind(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  std::vector<std::vector<float>> exact_before = exact.params;
  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
    absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), kind,
                                             Policy{}, StepSync{}, 0, {}, &delayed);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->delayed_subgroups, 5u);
    EXPECT_EQ(f.params, exact_before) << step;  // the step before's weights, installed
    ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
    for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << step << " " << t;
    exact_before = exact.params;
  }
  ASSERT_TRUE(ex.InstallPending(*f.shard, f.bindings, delayed).ok());
  EXPECT_EQ(f.params, exact.params);
  const std::vector<uint32_t> awaited = engine.awaited_captures();
  EXPECT_EQ(awaited.size(), 10u);  // every subgroup of both steps, each once
  const std::vector<StepPlan> plans = engine.plans();
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(std::vector<uint32_t>(awaited.begin(), awaited.begin() + 5), plans[0].delayed);
}

// A step's sync whose every subgroup is ready (backward is over).
StepSync AllReady() {
  StepSync sync;
  sync.is_ready = [](uint32_t) { return true; };
  sync.wait_ready = [](uint32_t) { return absl::OkStatus(); };
  return sync;
}

// A per-subgroup step on a GPU engine that another session is bound to
// waits on the host for every subgroup's gradients before it takes the engine
// (which runs one step at a time); alone on it, it waits inside, subgroup by
// subgroup, updating during backward.
TEST(StepExecutorTest, APerSubgroupStepOnASharedGpuWaitsForItsGradientsBeforeTheEngine) {
  for (const bool shared : {false, true}) {
    Fixture f;
    FakeEngine gpu(FakeEngine::Options{.gpu = true});
    StepExecutor ex(&gpu);
    ex.BindSession(1);
    if (shared) ex.BindSession(2);
    std::vector<size_t> plans_seen;  // per ready wait: the engine's plans begun by then
    StepSync sync = AllReady();
    sync.wait_ready = [&](uint32_t) {
      plans_seen.push_back(gpu.plans().size());
      return absl::OkStatus();
    };
    StepRequest r = Fixture::Request();
    r.flags = kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
    const StepKind kind(StepKind::Gradients::kPerSubgroup, false);
    absl::StatusOr<StepOutcome> out =
        ex.Run(*f.shard, f.bindings, r, kind, *ParsePolicy("static:0.5"), sync, 1, nullptr);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->step, 1);
    const size_t n = f.shard->subgroups().size();
    ASSERT_EQ(plans_seen.size(), shared ? 2 * n : n) << shared;
    EXPECT_EQ(plans_seen.front(), shared ? 0u : 1u) << shared;
    if (shared) {
      EXPECT_EQ(plans_seen[n - 1], 0u);
    }
  }
  // Once the other session is forgotten, the engine waits again.
  Fixture f;
  FakeEngine gpu(FakeEngine::Options{.gpu = true});
  StepExecutor ex(&gpu);
  ex.BindSession(1);
  ex.BindSession(2);
  ex.ForgetSession(2);
  size_t waits = 0;
  StepSync sync = AllReady();
  sync.wait_ready = [&](uint32_t) {
    ++waits;
    return absl::OkStatus();
  };
  StepRequest r = Fixture::Request();
  r.flags = kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
  ASSERT_TRUE(ex.Run(*f.shard, f.bindings, r, StepKind(StepKind::Gradients::kPerSubgroup, false),
                     *ParsePolicy("static:0.5"), sync, 1, nullptr)
                  .ok());
  EXPECT_EQ(waits, f.shard->subgroups().size());
}

// An early delayed step (protocol 8): the executor copies the delayed
// subgroups' gradients as their ready words come, before the verdict; a
// write to the gradients after that is not seen unless the verdict says
// so (kStepGradientsRewritten), and then the step copies them again.
void EarlyDelayedStep(bool rewritten) {
  Fixture f, exact;
  StepExecutor ex(&f.engine), ex_exact(&exact.engine);
  const float scale = rewritten ? 0.5f : 1.0f;
  for (std::vector<float>& g : exact.grads) {
    for (float& x : g) x *= scale;
  }
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  DelayedHost delayed(*f.shard, &f.budget);
  const StepSync sync = AllReady();
  const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    // Backward is over (every ready word stored): wait for the captures,
    // then write the gradients as an in-place clip would.
    for (int i = 0; i < 5000; ++i) {
      bool all = true;
      for (uint32_t sg = 0; sg < 5; ++sg) all = all && delayed.captured_early(sg);
      if (all) break;
      absl::SleepFor(absl::Milliseconds(1));
    }
    for (uint32_t sg = 0; sg < 5; ++sg) EXPECT_TRUE(delayed.captured_early(sg)) << sg;
    for (std::vector<float>& g : f.grads) {
      for (float& x : g) x *= scale;
    }
    if (!rewritten) {
      for (std::vector<float>& g : f.grads) std::fill(g.begin(), g.end(), 1e3f);
    }
    StepRequest r = Fixture::Request();
    if (rewritten) r.flags |= kStepGradientsRewritten;
    return r;
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, sync, 0, verdict, &delayed);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->delayed_subgroups, 5u);
  ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << t;
  ASSERT_TRUE(ex.InstallPending(*f.shard, f.bindings, delayed).ok());
  EXPECT_EQ(f.params, exact.params);
  EXPECT_GT(delayed.verdict_ns, 0u);
}

TEST(StepExecutorTest, AnEarlyDelayedStepCopiesTheGradientsBeforeItsVerdict) {
  EarlyDelayedStep(false);
}

TEST(StepExecutorTest, AVerdictThatRewroteTheGradientsHasThemCopiedAgain) {
  EarlyDelayedStep(true);
}

// Backward frees the last layers first: the captures take each subgroup as
// it becomes ready, not in plan order. With only the last two ready before
// the verdict, those two are copied during backward and the rest after it,
// and the step is the exact one applied late.
TEST(StepExecutorTest, AnEarlyDelayedStepCopiesTheSubgroupsReadyFirstWhateverTheirOrder) {
  Fixture f, exact;
  StepExecutor ex(&f.engine), ex_exact(&exact.engine);
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  DelayedHost delayed(*f.shard, &f.budget);
  std::atomic<bool> verdict_given{false};
  StepSync sync = AllReady();
  sync.is_ready = [&](uint32_t sg) { return sg >= 3 || verdict_given.load(); };
  const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    for (int i = 0; i < 5000 && !(delayed.captured_early(3) && delayed.captured_early(4)); ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    for (uint32_t sg = 0; sg < 5; ++sg) EXPECT_EQ(delayed.captured_early(sg), sg >= 3) << sg;
    verdict_given = true;
    return Fixture::Request();
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, sync, 0, verdict, &delayed);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->delayed_subgroups, 5u);
  FinishAndMatch(ex, f, delayed, exact);
}

// --delayed_handoff: the session leaves a delayed update running and hands
// it to the trainer's next early delayed step (DelayedHost::handed_off).
// That step's captures during backward wait for each subgroup's update,
// install its new weights and copy the step's gradients while the update
// still runs on the rest; its verdict joins the update. Steps so chained
// (a rewriting verdict among them) are the exact steps applied one late,
// and the trainer's weights after each are the exact ones of the step
// before.
TEST(StepExecutorTest, AHandedOffUpdateEndsInsideTheNextEarlyStep) {
  Fixture f, exact;
  FakeEngine slow(FakeEngine::Options{.slow_update_ms = 20});  // 100 ms an update
  PlannerOptions handoff;
  handoff.delayed_handoff = true;
  StepExecutor ex(&slow, handoff), ex_exact(&exact.engine);
  ASSERT_TRUE(ex.delayed_handoff());
  DelayedHost delayed(*f.shard, &f.budget);
  const StepSync sync = AllReady();
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  bool overlapped = false;
  auto step = [&](float scale, bool rewritten) {
    const std::vector<std::vector<float>> installed = exact.params;  // the last step's weights
    auto scale_grads = [scale](std::vector<std::vector<float>>& grads) {
      for (std::vector<float>& g : grads) {
        for (float& x : g) x *= scale;
      }
    };
    scale_grads(exact.grads);
    if (!rewritten) scale_grads(f.grads);
    ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
    const bool handed = delayed.update_in_flight();
    delayed.handed_off = handed;
    // After a rewriting verdict, the weights alone (the next test).
    const bool copies = !delayed.gradients_rewritten;
    const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
      // Backward is over: wait for the captures, which wait for the update.
      for (int i = 0; i < 5000; ++i) {
        bool all = copies || delayed.update_finished();
        for (uint32_t sg = 0; sg < 5 && copies; ++sg) all = all && delayed.captured_early(sg);
        overlapped =
            overlapped || (handed && delayed.captured_early(0) && !delayed.update_finished());
        if (all) break;
        absl::SleepFor(absl::Milliseconds(1));
      }
      absl::SleepFor(absl::Milliseconds(5));
      for (uint32_t sg = 0; sg < 5; ++sg) EXPECT_EQ(delayed.captured_early(sg), copies) << sg;
      if (rewritten) scale_grads(f.grads);  // after the copies: the step copies them again
      StepRequest r = Fixture::Request();
      if (rewritten) r.flags |= kStepGradientsRewritten;
      return r;
    };
    absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), kind,
                                             Policy{}, sync, 0, verdict, &delayed);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_FALSE(delayed.handed_off);
    EXPECT_EQ(f.params, installed);  // installed during backward, beside the update
    EXPECT_TRUE(delayed.pending().empty());
    EXPECT_EQ(delayed.captured().size(), 5u);  // this step's update, running
  };
  step(1.0f, false);  // nothing handed off yet
  step(0.5f, false);
  step(2.0f, true);
  step(1.0f, false);  // the weights alone during backward
  step(0.5f, false);
  EXPECT_TRUE(overlapped) << "no capture ran beside a handed-off update";
  FinishAndMatch(ex, f, delayed, exact);
}

// A handed-off update is joined by any step that cannot begin beside it
// (here an exact one) before it runs, and by a step that fails.
TEST(StepExecutorTest, AStepThatCannotTakeAHandOffJoinsItFirst) {
  Fixture f, exact;
  FakeEngine slow(FakeEngine::Options{.slow_update_ms = 20});
  PlannerOptions handoff;
  handoff.delayed_handoff = true;
  StepExecutor ex(&slow, handoff), ex_exact(&exact.engine);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepKind delays(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), delays, Policy{}, StepSync{}, 0, {},
                     &delayed)
                  .ok());
  ASSERT_TRUE(delayed.update_in_flight());
  // A step refused before it runs (a bad hyperparameter) still ends the update.
  delayed.handed_off = true;
  StepRequest bad = Fixture::Request();
  bad.groups[0].lr = -1;
  EXPECT_FALSE(
      ex.Run(*f.shard, f.bindings, bad, delays, Policy{}, StepSync{}, 0, {}, &delayed).ok());
  EXPECT_FALSE(delayed.update_in_flight());
  EXPECT_FALSE(delayed.handed_off);
  EXPECT_EQ(delayed.pending().size(), 5u);
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << t;
  // The exact step installs the pending weights and applies its own.
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  ASSERT_TRUE(ex.Run(*f.shard, f.bindings, Fixture::Request(), StepKind(), Policy{}, StepSync{}, 0,
                     {}, &delayed)
                  .ok());
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), exact.Master(t)) << t;
  EXPECT_EQ(f.params, exact.params);
}

// After a verdict that rewrote the gradients (an in-place clip), the next
// early step copies only the pending weights during backward: a write to
// its gradients before its verdict is seen without the flag. A verdict
// without it turns the gradients' early copies back on. Every step equals
// the exact one, applied a step late.
TEST(StepExecutorTest, AfterARewritingVerdictTheNextEarlyStepCopiesOnlyWeights) {
  Fixture f, exact;
  StepExecutor ex(&f.engine), ex_exact(&exact.engine);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepSync sync = AllReady();
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  auto step = [&](float scale, bool rewritten, bool early) {
    const std::vector<std::vector<float>> installed = exact.params;  // the last step's weights
    for (std::vector<float>& g : exact.grads) {
      for (float& x : g) x *= scale;
    }
    ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
    const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
      bool all = false;
      for (int i = 0; i < (early ? 5000 : 20) && !all; ++i) {
        absl::SleepFor(absl::Milliseconds(1));
        all = true;
        for (uint32_t sg = 0; sg < 5; ++sg) all = all && delayed.captured_early(sg);
      }
      for (uint32_t sg = 0; sg < 5; ++sg) EXPECT_EQ(delayed.captured_early(sg), early) << sg;
      for (std::vector<float>& g : f.grads) {
        for (float& x : g) x *= scale;
      }
      StepRequest r = Fixture::Request();
      if (rewritten) r.flags |= kStepGradientsRewritten;
      return r;
    };
    absl::StatusOr<StepOutcome> out = ex.Run(*f.shard, f.bindings, Fixture::Request(), kind,
                                             Policy{}, sync, 0, verdict, &delayed);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(f.params, installed);
    EXPECT_EQ(delayed.gradients_rewritten, rewritten);
    ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
    for (uint32_t t = 0; t < 2; ++t) {
      EXPECT_EQ(f.Master(t), exact.Master(t)) << "tensor " << t << " scale " << scale;
    }
  };
  step(0.5f, true, true);    // copied during backward, dropped, copied again
  step(2.0f, false, false);  // the weights alone during backward
  step(1.0f, false, true);   // the gradients too, once more (and nothing written after)
  ASSERT_TRUE(ex.InstallPending(*f.shard, f.bindings, delayed).ok());
  EXPECT_EQ(f.params, exact.params);
}

// Gradients scaled in place after the captures (protocol 9): the trainer
// stops dosd's captures (capture_stopped), waits until they are done
// (captures_done), multiplies every gradient by c (an in-place clip) and
// says so in its verdict (kStepGradientsScaled; with
// kStepGradientsScaledOnStream, protocol 11, the coefficient is read from
// the block after the trainer's event, and NaN there has them copied
// again; with kStepGradientsChecked a coefficient there, proof that the
// trainer's norm was finite, spares dosd's scan). The subgroups captured
// before are updated with their copies times c, bit for bit the exact step
// on the scaled gradients; those not captured before (a stop before any
// copy) are copied after the verdict as the multiply left them. A verdict
// whose captures were not stopped has them copied again. A stop that comes
// between the capture loop's check and a copy (protocol 10: the trainer did
// not see that copy begin, so it does not wait for it) is seen when the copy
// says it begins (capture_begins): no subgroup is copied after it.
enum class Stop { kAfterCaptures, kBeforeAny, kNever, kAsACopyBegins };
enum class Coef { kInVerdict, kOnStream, kOnStreamNaN, kOnStreamChecked, kOnStreamNaNChecked };

void EarlyScaledStep(Stop stop_when, Coef coef_by = Coef::kInVerdict) {
  Fixture f, exact;
  // Takes the trainer's event (the host engine refuses one); policy cpu: no
  // subgroup on its "GPU".
  FakeEngine events(FakeEngine::Options{.gpu = true});
  const bool on_stream = coef_by != Coef::kInVerdict;
  const bool nan = coef_by == Coef::kOnStreamNaN || coef_by == Coef::kOnStreamNaNChecked;
  const bool checked = coef_by == Coef::kOnStreamChecked || coef_by == Coef::kOnStreamNaNChecked;
  StepExecutor ex(on_stream ? static_cast<Engine*>(&events) : &f.engine), ex_exact(&exact.engine);
  const float c = 0.3719f;  // not a power of two: fl(g * c) rounds
  for (std::vector<float>& g : exact.grads) {
    for (float& x : g) x *= c;
  }
  ASSERT_TRUE(ex_exact.Run(*exact.shard, exact.bindings, Fixture::Request(), Policy{}).ok());
  DelayedHost delayed(*f.shard, &f.budget);
  std::atomic<bool> stop{stop_when == Stop::kBeforeAny}, done{false};
  std::atomic<int> begun{0};
  constexpr uint32_t kCopiedBeforeTheStop = 2;
  StepSync sync = AllReady();
  sync.capture_stopped = [&] { return stop.load(); };
  sync.capture_begins = [&] {
    if (stop_when == Stop::kAsACopyBegins && begun.fetch_add(1) == kCopiedBeforeTheStop) {
      stop.store(true);
    }
    return !stop.load();
  };
  sync.captures_done = [&] { done.store(true); };
  if (on_stream) {
    sync.trainer_event = *events.OpenTrainerEvent("trainer");
    sync.stream_coef = [&] { return nan ? std::nanf("") : c; };
  }
  // How many of the 5 subgroups are captured before the verdict (in the
  // plan's order).
  const uint32_t captured_before = stop_when == Stop::kBeforeAny       ? 0
                                   : stop_when == Stop::kAsACopyBegins ? kCopiedBeforeTheStop
                                                                       : 5;
  const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    if (stop_when == Stop::kAfterCaptures || stop_when == Stop::kNever) {
      for (int i = 0; i < 5000 && !delayed.captured_early(4); ++i) {
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    if (stop_when == Stop::kAfterCaptures) stop.store(true);  // kAsACopyBegins: by itself
    for (int i = 0; i < 5000 && !done.load(); ++i) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_TRUE(done.load());
    uint32_t captured = 0;
    for (uint32_t sg = 0; sg < 5; ++sg) captured += delayed.captured_early(sg) ? 1 : 0;
    EXPECT_EQ(captured, captured_before);
    for (std::vector<float>& g : f.grads) {
      for (float& x : g) x *= c;
    }
    StepRequest r = Fixture::Request();
    r.flags |= kStepGradientsScaled;
    r.gradient_coef = c;
    if (on_stream) {
      r.flags |= kStepGradientsScaledOnStream | kStepTrainerEventRecorded;
      r.gradient_coef = 1.0f;  // the client's placeholder
      if (checked) r.flags |= kStepGradientsChecked;
    }
    return r;
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind,
             on_stream ? Policy{.kind = Policy::Kind::kCpu} : Policy{}, sync, 0, verdict, &delayed);
  ASSERT_TRUE(out.ok()) << out.status();
  const bool kept = stop_when != Stop::kNever && !nan;
  EXPECT_EQ(delayed.early_coef(), kept ? c : 1.0f);
  EXPECT_EQ(delayed.gradients_rewritten, nan);
  if (on_stream) {
    // The host waited for the trainer's event before it read the block;
    // only a checked coefficient spares the scan.
    EXPECT_EQ(events.waits(), checked && !nan ? "ew" : "ews");
  }
  FinishAndMatch(ex, f, delayed, exact);
}

TEST(StepExecutorTest, AScaledVerdictUpdatesTheEarlyCopiesTimesItsCoefficient) {
  EarlyScaledStep(Stop::kAfterCaptures);
}

TEST(StepExecutorTest, AScaledVerdictBeforeAnyCaptureCopiesTheScaledGradients) {
  EarlyScaledStep(Stop::kBeforeAny);
}

TEST(StepExecutorTest, AScaledVerdictWhoseCapturesWereNotStoppedCopiesThemAgain) {
  EarlyScaledStep(Stop::kNever);
}

TEST(StepExecutorTest, AStopSeenAsACopyBeginsCopiesNothingMoreBeforeTheVerdict) {
  EarlyScaledStep(Stop::kAsACopyBegins);
}

TEST(StepExecutorTest, ACoefficientThroughTheStreamUpdatesTheEarlyCopiesTimesIt) {
  EarlyScaledStep(Stop::kAfterCaptures, Coef::kOnStream);
}

TEST(StepExecutorTest, ANaNThroughTheStreamHasTheGradientsCopiedAgain) {
  EarlyScaledStep(Stop::kAfterCaptures, Coef::kOnStreamNaN);
}

TEST(StepExecutorTest, ACheckedCoefficientThroughTheStreamSparesTheScan) {
  EarlyScaledStep(Stop::kAfterCaptures, Coef::kOnStreamChecked);
}

TEST(StepExecutorTest, ACheckedNaNThroughTheStreamIsScannedAndCopiedAgain) {
  EarlyScaledStep(Stop::kAfterCaptures, Coef::kOnStreamNaNChecked);
}

// The trainer sends NaN where its norm was not finite: dosd scans, finds
// the inf and applies nothing, though the verdict says kStepGradientsChecked.
TEST(StepExecutorTest, ANaNThroughTheStreamIsNoProofOfFiniteGradients) {
  Fixture f;
  FakeEngine events(FakeEngine::Options{.gpu = true});
  StepExecutor ex(&events);
  f.grads[1][77] = std::numeric_limits<float>::infinity();
  StepSync sync = AllReady();
  sync.trainer_event = *events.OpenTrainerEvent("trainer");
  sync.stream_coef = [] { return std::nanf(""); };
  const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    StepRequest r = Fixture::Request();
    r.flags |= kStepGradientsChecked | kStepGradientsScaled | kStepGradientsScaledOnStream |
               kStepTrainerEventRecorded;
    return r;
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kNone);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{.kind = Policy::Kind::kCpu},
             sync, 0, verdict, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->found_inf);
  EXPECT_EQ(events.waits(), "ews");
  EXPECT_EQ(f.shard->tensors()[1].step, 0);
}

TEST(StepExecutorTest, AStreamCoefficientWithoutItsEventIsRefused) {
  StepRequest r = Fixture::Request();
  r.flags |= kStepGradientsScaled | kStepGradientsScaledOnStream;
  const absl::Status st = ValidateStepRequest(r, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("kStepTrainerEventRecorded"), absl::string_view::npos) << st;
}

// A non-delayed early step (nothing to capture) tells a trainer waiting to
// scale its gradients at once.
TEST(StepExecutorTest, AnEarlyStepWithoutCapturesSaysSoAtOnce) {
  Fixture f;
  StepExecutor ex(&f.engine);
  bool done = false;
  StepSync sync = AllReady();
  sync.captures_done = [&] { done = true; };
  const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    EXPECT_TRUE(done);
    return Fixture::Request();
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kNone);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, sync, 0, verdict, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(done);
}

// A step given up at its verdict drops what it copied: the next step reads
// its own gradients.
TEST(StepExecutorTest, AnAbandonedEarlyDelayedStepKeepsNoCapture) {
  Fixture f;
  StepExecutor ex(&f.engine);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepSync sync = AllReady();
  const AwaitVerdict abandon = [&]() -> absl::StatusOr<StepRequest> {
    for (int i = 0; i < 5000 && !delayed.captured_early(4); ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    StepRequest r{};
    r.flags = kStepAbandon;
    return r;
  };
  const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, sync, 0, abandon, &delayed);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kAborted) << out.status();
  for (uint32_t sg = 0; sg < 5; ++sg) EXPECT_FALSE(delayed.captured_early(sg)) << sg;
  EXPECT_TRUE(delayed.captured().empty());
}

// An early delayed step's window ends when the trainer gave its verdict
// (the verdict's ring_ns), not when dosd got to it; a time dosd has not
// reached yet is not believed.
TEST(StepExecutorTest, AnEarlyDelayedStepsWindowEndsAtTheTrainersVerdict) {
  for (bool future : {false, true}) {
    Fixture f;
    StepExecutor ex(&f.engine);
    DelayedHost delayed(*f.shard, &f.budget);
    const StepSync sync = AllReady();
    const uint64_t given = future ? MonotonicNs() + 3'600'000'000'000 : MonotonicNs() - 5'000'000;
    const AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
      StepRequest r = Fixture::Request();
      r.ring_ns = given;
      return r;
    };
    const StepKind kind(StepKind::Gradients::kAtVerdict, false, StepKind::Delay::kHost);
    const uint64_t before = MonotonicNs();
    ASSERT_TRUE(
        ex.Run(*f.shard, f.bindings, Fixture::Request(), kind, Policy{}, sync, 0, verdict, &delayed)
            .ok());
    if (future) {
      EXPECT_GE(delayed.verdict_ns, before);
      EXPECT_LE(delayed.verdict_ns, MonotonicNs());
    } else {
      EXPECT_EQ(delayed.verdict_ns, given);
    }
    ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
  }
}

TEST(StepExecutorTest, AFinishRequestInstallsAndAppliesNothing) {
  Fixture f;
  StepExecutor ex(&f.engine);
  DelayedHost delayed(*f.shard, &f.budget);
  const StepKind host(StepKind::Gradients::kFinal, false, StepKind::Delay::kHost);
  const StepKind finish(StepKind::Gradients::kFinal, false, StepKind::Delay::kFinish);
  ASSERT_TRUE(
      ex.Run(*f.shard, f.bindings, Fixture::Request(), host, Policy{}, StepSync{}, 0, {}, &delayed)
          .ok());
  ASSERT_TRUE(ex.UpdateDelayed(*f.shard, delayed).ok());
  const std::vector<float> master = f.Master(1);
  StepRequest r{};  // a finish carries no hyperparameters
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, r, finish, Policy{}, StepSync{}, 0, {}, &delayed);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->step, 1);
  EXPECT_EQ(f.Master(1), master);
  EXPECT_EQ(f.params[1], master);  // fp32 weights: the masters themselves
  EXPECT_TRUE(delayed.pending().empty());
  // Without the session's delayed path a delayed kind is a bug, not a step.
  EXPECT_EQ(ex.Run(*f.shard, f.bindings, Fixture::Request(), host, Policy{}, StepSync{}, 0, {})
                .status()
                .code(),
            absl::StatusCode::kInternal);
}

TEST(ValidateStepRequestTest, FollowsTorchsRulesForEveryField) {
  StepRequest r{};
  r.num_groups = 2;
  r.grad_scale = 1;
  r.clip_coef = 1;
  r.groups[0] = GroupStepParams{1e-3, 0.9, 0.999, 0.0, 0.0};  // eps = 0, wd = 0: valid
  r.groups[1] = GroupStepParams{0.0, 0.0, 0.0, 1e-8, 0.1};     // lr = 0, betas 0: valid
  EXPECT_TRUE(ValidateStepRequest(r, 2).ok());
  struct Bad {
    double GroupStepParams::*field;
    double value;
    const char* name;
  };
  const double inf = std::numeric_limits<double>::infinity();
  for (const Bad& b : {Bad{&GroupStepParams::lr, -1e-3, "lr"}, Bad{&GroupStepParams::lr, inf, "lr"},
                       Bad{&GroupStepParams::beta1, 1.0, "beta1"},
                       Bad{&GroupStepParams::beta2, -0.1, "beta2"},
                       Bad{&GroupStepParams::eps, -1e-12, "eps"},
                       Bad{&GroupStepParams::eps, std::nan(""), "eps"},
                       Bad{&GroupStepParams::weight_decay, -0.01, "weight_decay"}}) {
    StepRequest bad = r;
    bad.groups[1].*b.field = b.value;
    absl::Status st = ValidateStepRequest(bad, 2);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.name;
    EXPECT_NE(st.message().find(absl::StrCat("step: group 1 ", b.name, " = ")),
              absl::string_view::npos) << st;
  }
  StepRequest scale = r;
  scale.grad_scale = 0;
  EXPECT_EQ(ValidateStepRequest(scale, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateStepRequest(r, 1).code(), absl::StatusCode::kInvalidArgument);
}

// Early steps (kStepGradientsPending): without a verdict the engine asks
// for each subgroup's readiness before updating it, last subgroup first, and
// the result equals a synchronous step's; with one, nothing is applied until
// the verdict, whose hyperparameters are the step's; an abandoned verdict
// applies nothing.
// The step's kind, as the session decodes it where it reads the request.
StepKind Kind(const StepRequest& r) { return *StepKind::Decode(r.flags, false); }

TEST(StepExecutorTest, AnEarlyStepWithoutAVerdictWaitsPerSubgroupAndMatches) {
  Fixture ref;
  StepExecutor ref_ex(&ref.engine);
  ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, Fixture::Request(), Policy{}).ok());

  Fixture f;
  StepExecutor ex(&f.engine);
  StepRequest r = Fixture::Request();
  r.flags = kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
  std::vector<uint32_t> asked;
  StepSync sync;
  sync.wait_ready = [&](uint32_t sg) {
    asked.push_back(sg);
    return absl::OkStatus();
  };
  sync.is_ready = [](uint32_t) { return true; };
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, r, Kind(r), Policy{}, sync, 0, {});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->early);
  EXPECT_EQ(out->step, 1);
  EXPECT_EQ(asked, (std::vector<uint32_t>{4, 3, 2, 1, 0}));
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), ref.Master(t));

  // Without kStepGradientsChecked no scan could precede the first update.
  r.flags = kStepGradientsPending | kStepNoVerdict;
  EXPECT_EQ(StepKind::Decode(r.flags, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Without a verdict, the tensors the trainer found without a gradient at
// step() (StepSync::late_skip, published before their subgroups are marked
// ready) keep their state and step count; a late message with anything but
// the skip mask is ignored (failing there would leave the step half
// applied): the step is applied whole.
TEST(StepExecutorTest, AnEarlyStepWithoutAVerdictSkipsTheTensorsPublishedLate) {
  Fixture ref;
  StepExecutor ref_ex(&ref.engine);
  StepRequest skip1 = Fixture::Request();
  skip1.flags = kStepSkipTensors;
  skip1.skip[0] = uint64_t{1} << 1;
  ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, skip1, Policy{}).ok());

  Fixture f;
  const std::vector<float> before = f.Master(1);
  StepExecutor ex(&f.engine);
  StepRequest r = Fixture::Request();
  r.flags = kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
  StepRequest late{};
  late.seq = r.seq;
  late.flags = kStepSkipTensors;
  late.skip[0] = uint64_t{1} << 1;
  int asked = 0;
  StepSync sync;
  sync.wait_ready = [](uint32_t) { return absl::OkStatus(); };
  sync.is_ready = [](uint32_t) { return true; };
  sync.late_skip = [&](StepRequest* out) {
    ++asked;
    *out = late;
    return true;
  };
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, r, Kind(r), Policy{}, sync, 0, {});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(asked, 1);  // read once, when the first subgroup was ready
  EXPECT_EQ(f.Master(0), ref.Master(0));
  EXPECT_EQ(f.Master(1), before);
  EXPECT_EQ(f.shard->tensors()[0].step, 1);
  EXPECT_EQ(f.shard->tensors()[1].step, 0);

  Fixture whole;
  StepExecutor whole_ex(&whole.engine);
  ASSERT_TRUE(whole_ex.Run(*whole.shard, whole.bindings, Fixture::Request(), Policy{}).ok());
  Fixture g;
  StepExecutor g_ex(&g.engine);
  late.flags = kStepSkipTensors | kStepAbandon;
  out = g_ex.Run(*g.shard, g.bindings, r, Kind(r), Policy{}, sync, 0, {});
  ASSERT_TRUE(out.ok()) << out.status();
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(g.Master(t), whole.Master(t));
  EXPECT_EQ(g.shard->tensors()[1].step, 1);
}

TEST(StepExecutorTest, AFailedReadyWaitStopsTheEarlyStep) {
  Fixture f;
  StepExecutor ex(&f.engine);
  StepRequest r = Fixture::Request();
  r.flags = kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked;
  StepSync sync;
  sync.wait_ready = [](uint32_t) { return absl::UnavailableError("trainer gone"); };
  sync.is_ready = [](uint32_t) { return false; };
  const std::vector<float> before = f.Master(0);
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, r, Kind(r), Policy{}, sync, 0, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(f.Master(0), before);
  EXPECT_EQ(f.shard->tensors()[0].step, 0);
}

TEST(StepExecutorTest, AnEarlyStepAppliesTheVerdictsHyperparameters) {
  Fixture ref;
  StepRequest final_request = Fixture::Request();
  final_request.clip_coef = 0.25;
  final_request.groups[0].lr = 3e-3;
  StepExecutor ref_ex(&ref.engine);
  ASSERT_TRUE(ref_ex.Run(*ref.shard, ref.bindings, final_request, Policy{}).ok());

  Fixture f;
  StepExecutor ex(&f.engine);
  StepRequest begun = Fixture::Request();
  begun.flags = kStepGradientsPending;
  begun.groups[0].lr = -1;  // not final: validated only in the verdict
  bool asked = false;
  AwaitVerdict verdict = [&]() -> absl::StatusOr<StepRequest> {
    asked = true;
    EXPECT_EQ(f.shard->tensors()[0].step, 0);  // nothing applied before it
    return final_request;
  };
  absl::StatusOr<StepOutcome> out =
      ex.Run(*f.shard, f.bindings, begun, Kind(begun), Policy{}, {}, 0, verdict);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(asked);
  EXPECT_TRUE(out->early);
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(f.Master(t), ref.Master(t));

  StepRequest abandon{};
  abandon.flags = kStepAbandon;
  const std::vector<float> before = f.Master(1);
  out = ex.Run(*f.shard, f.bindings, begun, Kind(begun), Policy{}, {}, 0,
               [&]() -> absl::StatusOr<StepRequest> { return abandon; });
  EXPECT_EQ(out.status().code(), absl::StatusCode::kAborted) << out.status();
  EXPECT_EQ(f.Master(1), before);
  EXPECT_EQ(f.shard->tensors()[1].step, 1);
}

}  // namespace
}  // namespace dos
