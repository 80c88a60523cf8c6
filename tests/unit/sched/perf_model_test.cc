// PerfModel (DESIGN.md section 4) on the figures of section 7: the binding
// constraint and best GPU share, and the phase time with pipeline fill/drain.
#include "daemon/sched/perf_model.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "tests/unit/sched/planner_test_util.h"

namespace dos {
namespace {

PerfInputs H200() { return testing::H200Rates(); }

TEST(PerfModelTest, CpuOnlyIsCpuBound) {
  PerfPrediction p = PerfModel::Bound(H200(), 0.0);
  EXPECT_EQ(p.binding, "cpu");
  EXPECT_DOUBLE_EQ(p.params_per_s, 3.7e9);
}

TEST(PerfModelTest, BestShareOnH200IsAboutTwoThirdsAndHostOrPcieBound) {
  PerfPrediction p = PerfModel::Solve(H200());
  EXPECT_NEAR(p.gpu_share, 0.66, 0.05);
  EXPECT_NEAR(p.params_per_s, 5.4e9, 0.3e9);
  EXPECT_TRUE(p.binding == "host_memory" || p.binding == "pcie_both") << p.binding;
}

TEST(PerfModelTest, AllGpuIsPcieBound) {
  PerfPrediction p = PerfModel::Bound(H200(), 1.0);
  EXPECT_EQ(p.binding, "pcie_both");
  EXPECT_NEAR(p.params_per_s, 97e9 / 24, 1e6);
}

TEST(PerfModelTest, PhaseTimeAddsOneSubgroupOfPipelineFillAndDrain) {
  const PerfInputs in = H200();
  const double r = PerfModel::Bound(in, 0.5).params_per_s;
  EXPECT_DOUBLE_EQ(PerfModel::PhaseSeconds(in, 0.5, 2e9, 0), 2e9 / r);
  // With a GPU share: one subgroup's 12 B/param state copy is exposed.
  EXPECT_DOUBLE_EQ(PerfModel::PhaseSeconds(in, 0.5, 2e9, 0, 1e8), 2e9 / r + 12 * 1e8 / 55e9);
  // CPU only: the first gradient D2H and the last weight H2D (2 B each).
  const double rc = PerfModel::Bound(in, 0.0).params_per_s;
  EXPECT_DOUBLE_EQ(PerfModel::PhaseSeconds(in, 0.0, 2e9, 0, 1e8), 2e9 / rc + 4 * 1e8 / 55e9);
  // Resident parameters add their kernel time only.
  EXPECT_DOUBLE_EQ(PerfModel::PhaseSeconds(in, 0.0, 0, 1e9, 1e8), 1e9 / 120e9);
}

// Compact state (8 bytes a parameter): the CPU kernel moves 20 bytes instead
// of 28 (bf16 gradient and weight), so its rate scales by 28/20, and the GPU
// path moves 8 bytes each way instead of 12. DESIGN.md section 7 gives about
// 7.8 Gparam/s for this bound with all state on the host.
TEST(PerfModelTest, CompactStateScalesCpuRateAndPcieBytes) {
  PerfInputs in = H200();
  in.state_bytes = 8;
  EXPECT_DOUBLE_EQ(CpuRate(in), 3.7e9 * 28 / 20);
  PerfPrediction cpu = PerfModel::Bound(in, 0.0);
  EXPECT_EQ(cpu.binding, "cpu");
  EXPECT_DOUBLE_EQ(cpu.params_per_s, 3.7e9 * 28 / 20);
  PerfPrediction gpu = PerfModel::Bound(in, 1.0);
  EXPECT_EQ(gpu.binding, "pcie_both");
  EXPECT_NEAR(gpu.params_per_s, 97e9 / 16, 1e6);
  PerfPrediction best = PerfModel::Solve(in);
  EXPECT_NEAR(best.params_per_s, 7.8e9, 0.4e9);
  EXPECT_GT(best.params_per_s, 1.35 * PerfModel::Solve(H200()).params_per_s);
  // One subgroup's 8 B/param state copy is the exposed pipeline fill.
  const double r = PerfModel::Bound(in, 0.5).params_per_s;
  EXPECT_DOUBLE_EQ(PerfModel::PhaseSeconds(in, 0.5, 2e9, 0, 1e8), 2e9 / r + 8 * 1e8 / 55e9);
}

// A compact session's CPU measurement teaches the fp32-state rate: 5.18
// Gparam/s at 20 bytes is 3.7 Gparam/s at 28.
TEST(PerfModelTest, CompactCpuMeasurementsAreKeptAsTheFp32Rate) {
  PerfInputs start = H200();
  PerfModel m(start);
  m.set_transfer_sizes(2, 2, 8);
  for (int i = 0; i < 50; ++i) m.ObserveCpu(3.7e9 * 28 / 20, 1.0);
  EXPECT_NEAR(m.inputs().cpu_params_per_s, 3.7e9, 1e6);
  EXPECT_NEAR(CpuRate(m.inputs()), 3.7e9 * 28 / 20, 1e6);
}

// A delayed step whose update runs beside the streamed transfers: the DMA
// engines (97 GB/s of PCIe, 24 B per parameter) and the cores (3.7 Gparam/s at
// 28 B) want 200 GB/s of 145, so the streamed part is stretched by f - 1 for
// as long as both run; the section 7 run of both at once saw 1.3-1.4.
// --delayed_gpu_path: the GPU's delayed subgroups are captured and
// installed with the CPU's in the step, and cross PCIe in the window (14
// bytes a parameter each way for fp32 state), sharing host memory with the
// CPU's update while both run.
TEST(PerfModelTest, TheGpusDelayedSubgroupsCrossPcieInTheWindow) {
  const PerfInputs in = H200();
  DelayedStepShape shape;
  shape.resident = 2e9;
  shape.delayed_gpu = 0.5e9;
  shape.window_s = 0.3;
  DelayedStepTimes t = PerfModel::DelayedStep(in, shape);
  EXPECT_NEAR(t.gpu_update_s, 0.5e9 * 14 / 55e9, 1e-9);
  EXPECT_NEAR(t.step_s, std::max(PerfModel::PhaseSeconds(in, 1.0, 0, 2e9), 0.5e9 * 2 / 55e9), 1e-9);
  EXPECT_DOUBLE_EQ(t.overrun_s, 0);
  shape.window_s = 0.1;  // 0.127 s of transfers: the trainer waits for the rest
  t = PerfModel::DelayedStep(in, shape);
  EXPECT_NEAR(t.overrun_s, 0.5e9 * 14 / 55e9 - 0.1, 1e-9);
  // Beside a CPU update both stretch by f over their overlap.
  shape.window_s = 0.3;
  shape.delayed = 0.37e9;  // 0.1 s alone
  shape.delayed_rate = 3.7e9;
  t = PerfModel::DelayedStep(in, shape);
  const double f = (28 * 55e9 / 14 + 3.7e9 * 28) / 145e9;
  EXPECT_GT(f, 1);
  EXPECT_NEAR(t.update_s, 0.1 * f, 1e-9);
  EXPECT_NEAR(t.gpu_update_s, 0.5e9 * 14 / 55e9 + 0.1 * (f - 1), 1e-9);
}

TEST(PerfModelTest, ADelayedUpdateBesideTheStreamedPathSharesHostMemory) {
  const PerfInputs in = H200();
  const double path_rate = PerfModel::Bound(in, 1.0).params_per_s;
  DelayedStepShape shape;
  shape.streamed = 1e9;  // 0.25 s alone
  shape.resident = 2e9;
  shape.delayed = 0.37e9;  // 0.1 s of update, all beside the streamed part
  shape.delayed_rate = 3.7e9;
  shape.window_s = 0.3;
  const double f = (97e9 + 3.7e9 * 28) / 145e9;
  const double alone_s = PerfModel::PhaseSeconds(in, 1.0, 1e9, 2e9);
  DelayedStepTimes t = PerfModel::DelayedStep(in, shape);
  EXPECT_NEAR(t.slowdown, f, 1e-9);
  EXPECT_NEAR(t.slowdown, 1.38, 0.01);
  EXPECT_NEAR(t.step_s, alone_s + 0.1 * (f - 1), 1e-9);
  EXPECT_DOUBLE_EQ(t.overrun_s, 0);
  // A longer update starts after its longer capture and overlaps the rest of
  // the path, then runs into the window: what the window does not hold is
  // the overrun.
  shape.delayed = 3.7e9;  // 1 s
  t = PerfModel::DelayedStep(in, shape);
  const double capture_s = 3.7e9 * 2 / 55e9;
  ASSERT_LT(alone_s - capture_s, 1e9 / path_rate);
  const double step_s = alone_s + (alone_s - capture_s) * (f - 1);
  EXPECT_NEAR(t.step_s, step_s, 1e-9);
  EXPECT_NEAR(t.overrun_s, capture_s + 1.0 - step_s - 0.3, 1e-9);
  // Started at the result the update overlaps no transfer, and has only the window.
  shape.start_at_result = true;
  t = PerfModel::DelayedStep(in, shape);
  EXPECT_DOUBLE_EQ(t.slowdown, 1);
  EXPECT_NEAR(t.step_s, std::max(alone_s, capture_s), 1e-9);
  EXPECT_NEAR(t.overrun_s, 1.0 - 0.3, 1e-9);
  // Nothing streamed (compact state held resident) or room in host memory: no stretch.
  shape.start_at_result = false;
  shape.streamed = 0;
  EXPECT_DOUBLE_EQ(PerfModel::DelayedStep(in, shape).slowdown, 1);
  shape.streamed = 1e9;
  // The learned M_host (an effective figure, above the probe's) does not
  // hide the sharing: the seeded one decides it.
  PerfInputs learned = in;
  learned.host_bytes_per_s = 273e9;
  EXPECT_NEAR(PerfModel::DelayedStep(learned, shape).slowdown, f, 1e-9);
  PerfInputs roomy = in;
  roomy.host_shared_bytes_per_s = 400e9;
  EXPECT_DOUBLE_EQ(PerfModel::DelayedStep(roomy, shape).slowdown, 1);
}

}  // namespace
}  // namespace dos
