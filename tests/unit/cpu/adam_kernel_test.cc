// Every kernel variant this CPU runs, for every gradient x weight dtype, at
// awkward sizes and unaligned starts, in L2 and decoupled modes, over steps
// with different bias corrections, against the double reference; vector
// variants must also equal the scalar kernel bit for bit.
//
// Tolerance: |kernel - reference| <= 32 * 2^-24 * magnitude, where magnitude
// is the sum of the absolute values of the terms that form the result (see
// adam_reference.h). Each output is a chain of at most ~16 fp32 roundings
// (the five float-rounded scalars it uses plus about ten operations), each
// off by at most 2^-24 relative to the terms it combines, so 16 * 2^-24 is
// the worst case; 32 leaves a factor two. It is still ~2000x tighter than a
// bf16 rounding, so a wrong operation order, a missing term or a wrong
// scalar (e.g. bias correction of the wrong step) fails it.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/cpu/adam_reference.h"
#include "daemon/cpu/kernel_variants.h"
#include "gtest/gtest.h"
#include "tests/unit/cpu/adam_test_data.h"

namespace dos::cpu {
namespace {

using internal::KernelVariant;
using testing::AdamBuffers;
using testing::RoundBits;

constexpr double kTolerance = 32.0 * 0x1p-24;
constexpr size_t kSizes[] = {1, 7, 22, 64, (1u << 20) + 3};
constexpr int64_t kSteps[] = {1, 2, 1000};

GroupStepParams Group() { return {/*lr=*/1e-2, 0.9, 0.999, 1e-8, /*weight_decay=*/0.1}; }

void ExpectClose(const char* what, float got, const ReferenceValue& want, size_t i) {
  const double err = std::fabs(static_cast<double>(got) - want.value);
  ASSERT_LE(err, kTolerance * want.magnitude + 1e-40)
      << what << "[" << i << "] got " << got << " want " << want.value << " magnitude "
      << want.magnitude;
}

bool SameBits(float a, float b) { return FloatToBits(a) == FloatToBits(b); }

class AdamKernelTest
    : public ::testing::TestWithParam<std::tuple<std::string_view, DType, DType>> {
 protected:
  void SetUp() override {
    for (const KernelVariant& k : internal::AllKernelVariants()) {
      if (k.name == std::get<0>(GetParam())) variant_ = k;
    }
    bool supported = false;
    for (const KernelVariant& k : internal::SupportedKernelVariants()) {
      supported |= k.name == variant_.name;
    }
    if (!supported) GTEST_SKIP() << "this CPU lacks " << variant_.name << "; variant not run";
  }
  KernelVariant variant_{};
};

TEST_P(AdamKernelTest, MatchesReferenceAndScalar) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  const bool is_scalar = variant_.name == "scalar";
  for (bool decoupled : {false, true}) {
    for (size_t n : kSizes) {
      SCOPED_TRACE(::testing::Message() << "decoupled=" << decoupled << " n=" << n);
      const size_t offset = n % 3;  // unaligned starts for some sizes
      AdamBuffers buf(n, grad_dtype, param_dtype, offset, /*seed=*/n * 2 + decoupled);
      AdamBuffers scalar_buf = buf;
      std::vector<ReferenceElement> ref(n);
      for (int64_t step : kSteps) {
        SCOPED_TRACE(::testing::Message() << "step=" << step);
        const double grad_scale = 1024.0, clip = 0.37;
        const ReferenceHyper hyper{Group(), decoupled, step, grad_scale, clip};
        AdamReference(hyper, buf.Span(), ref.data());
        const AdamScalars s = MakeAdamScalars(Group(), decoupled, step, grad_scale, clip);
        variant_.adam(s, buf.Span());
        if (!is_scalar) internal::AdamScalarKernel(s, scalar_buf.Span());
        for (size_t i = 0; i < n; ++i) {
          const size_t k = i + offset;
          ExpectClose("p", buf.master[k], ref[i].p, i);
          ExpectClose("m", buf.exp_avg[k], ref[i].m, i);
          ExpectClose("v", buf.exp_avg_sq[k], ref[i].v, i);
          ASSERT_EQ(buf.OutBits(i), RoundBits(param_dtype, buf.master[k])) << i;
          if (!is_scalar) {
            ASSERT_TRUE(SameBits(buf.master[k], scalar_buf.master[k])) << i;
            ASSERT_TRUE(SameBits(buf.exp_avg[k], scalar_buf.exp_avg[k])) << i;
            ASSERT_TRUE(SameBits(buf.exp_avg_sq[k], scalar_buf.exp_avg_sq[k])) << i;
            ASSERT_EQ(buf.OutBits(i), scalar_buf.OutBits(i)) << i;
          }
        }
        if (HasFatalFailure()) return;
      }
    }
  }
}

// lr = 0 leaves every weight as it was, so the trainer weight must be exactly
// dtype.h's rounding of it: ties, subnormals (vcvtneps2bf16 flushes them;
// the kernel must not), overflow, infinities and NaN payloads.
TEST_P(AdamKernelTest, WeightRoundingOfSpecialValues) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  std::vector<uint32_t> bits = {
      0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007fffff,
      0x807f8000, 0x00800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0x7f7f7fff,
      0x7f7f8000, 0xff7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f812345, 0xffc0dead,
      0x477fefff, 0x477ff000, 0x33000000, 0x33000001, 0x38800000, 0x387fe000, 0xb87ff000,
      0x3c00f000, 0x3c001000, 0x3c003000, 0x3c002fff};
  for (uint32_t i = 0; bits.size() < 77; ++i) bits.push_back(0x00001000u * i + 0x8fffu);
  const size_t n = bits.size();
  AdamBuffers buf(n, grad_dtype, param_dtype, /*offset=*/1, /*seed=*/7);
  for (size_t i = 0; i < n; ++i) buf.master[i + 1] = BitsToFloat(bits[i]);
  AdamBuffers scalar_buf = buf;
  GroupStepParams group = Group();
  group.lr = 0.0;
  group.weight_decay = 0.0;
  const AdamScalars s = MakeAdamScalars(group, /*decoupled_weight_decay=*/true, 5, 1.0, 1.0);
  variant_.adam(s, buf.Span());
  internal::AdamScalarKernel(s, scalar_buf.Span());
  for (size_t i = 0; i < n; ++i) {
    const float p = buf.master[i + 1];
    if (std::isnan(BitsToFloat(bits[i]))) {
      ASSERT_TRUE(std::isnan(p)) << i;
    } else {
      ASSERT_TRUE(SameBits(p, BitsToFloat(bits[i]))) << std::hex << bits[i];
    }
    ASSERT_EQ(buf.OutBits(i), RoundBits(param_dtype, p)) << std::hex << bits[i];
    ASSERT_EQ(buf.OutBits(i), scalar_buf.OutBits(i)) << std::hex << bits[i];
  }
}

TEST_P(AdamKernelTest, NullOutputAndAliasedFp32Output) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  const AdamScalars s = MakeAdamScalars(Group(), true, 3, 1.0, 1.0);
  AdamBuffers a(1000, grad_dtype, param_dtype, 0, 11);
  AdamBuffers b = a;
  const std::vector<char> untouched = a.out;
  variant_.adam(s, a.Span(/*write_out=*/false));
  EXPECT_EQ(a.out, untouched);
  // Writing the fp32 weight over the master copy itself is allowed.
  AdamSpan aliased = b.Span(false);
  aliased.param_out = aliased.master;
  aliased.param_dtype = DType::kF32;
  variant_.adam(s, aliased);
  for (size_t i = 0; i < 1000; ++i) ASSERT_TRUE(SameBits(a.master[i], b.master[i])) << i;
}

std::string Name(const ::testing::TestParamInfo<AdamKernelTest::ParamType>& info) {
  return std::string(std::get<0>(info.param)) + "_grad_" +
         std::string(DTypeName(std::get<1>(info.param))) + "_out_" +
         std::string(DTypeName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    AllVariants, AdamKernelTest,
    ::testing::Combine(::testing::Values("scalar", "avx2", "avx512", "avx512bf16"),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)),
    Name);

TEST(AdamScalarsTest, MatchesTorchFormulas) {
  const GroupStepParams g{1e-3, 0.9, 0.999, 1e-8, 0.01};
  const AdamScalars w = MakeAdamScalars(g, true, 10, 65536.0, 0.5);
  EXPECT_EQ(w.decay_factor, static_cast<float>(1.0 - 1e-3 * 0.01));
  EXPECT_EQ(w.l2_weight_decay, 0.0f);
  EXPECT_EQ(w.neg_step_size, static_cast<float>(-1e-3 / (1.0 - std::pow(0.9, 10))));
  EXPECT_EQ(w.bias_correction2_sqrt, static_cast<float>(std::sqrt(1.0 - std::pow(0.999, 10))));
  EXPECT_EQ(w.inv_grad_scale, 0x1p-16f);
  EXPECT_EQ(w.one_minus_beta2, static_cast<float>(1.0 - 0.999));
  const AdamScalars l2 = MakeAdamScalars(g, false, 1, 1.0, 1.0);
  EXPECT_EQ(l2.decay_factor, 1.0f);
  EXPECT_EQ(l2.l2_weight_decay, 0.01f);
}

TEST(IsaTest, ParseNameAndCap) {
  Isa isa;
  for (Isa want : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    ASSERT_TRUE(ParseIsa(IsaName(want), &isa));
    EXPECT_EQ(isa, want);
  }
  EXPECT_FALSE(ParseIsa("sse9", &isa));
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  EXPECT_TRUE(IsaSupported(BestIsa()));
  setenv("DOS_CPU_ISA", "scalar", 1);
  EXPECT_EQ(BestIsa(), Isa::kScalar);
  setenv("DOS_CPU_ISA", "avx512", 1);  // a cap, never a raise
  EXPECT_TRUE(IsaSupported(BestIsa()));
  unsetenv("DOS_CPU_ISA");
  std::string names;
  for (const auto& k : internal::SupportedKernelVariants()) names += std::string(k.name) + " ";
  std::printf("kernel variants this CPU runs: %s\n", names.c_str());
}

}  // namespace
}  // namespace dos::cpu
