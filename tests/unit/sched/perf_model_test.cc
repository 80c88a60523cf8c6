// PerfModel (DESIGN.md section 4) on the figures of section 7: the binding
// constraint and best GPU share, and the phase time with pipeline fill/drain.
#include "daemon/sched/perf_model.h"

#include <gtest/gtest.h>

namespace dos {
namespace {

PerfInputs H200() {
  PerfInputs in;
  in.cpu_params_per_s = 3.7e9;
  in.gpu_params_per_s = 120e9;
  in.h2d_bytes_per_s = 55e9;
  in.d2h_bytes_per_s = 55e9;
  in.pcie_both_bytes_per_s = 97e9;
  in.host_bytes_per_s = 145e9;
  return in;
}

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

}  // namespace
}  // namespace dos
