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
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/cpu/adam_reference.h"
#include "daemon/cpu/kernel_variants.h"
#include "gtest/gtest.h"
#include "tests/support/dtype_print.h"
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

// The streaming variants take their non-temporal path only when the arrays
// they write line up after the head step; std::vector's buffers rarely do.
// Here every array sits at a chosen offset from a 64-byte boundary, so each
// variant runs both its streaming body (equal offsets) and its fallback
// (unequal ones), and must equal the scalar kernel bit for bit either way.
TEST_P(AdamKernelTest, AlignedAndMisalignedArraysMatchScalar) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  const size_t n = 4096 + 37;
  const AdamScalars s = MakeAdamScalars(Group(), true, 7, 1.0, 1.0);
  struct Offsets {
    size_t master, m, v, out;
  };
  for (const Offsets o : {Offsets{0, 0, 0, 0}, Offsets{5, 5, 5, 5}, Offsets{16, 16, 16, 16},
                          Offsets{3, 3, 3, 11}, Offsets{0, 1, 0, 0}, Offsets{2, 2, 9, 2}}) {
    SCOPED_TRACE(::testing::Message() << "offsets " << o.master << "," << o.m << "," << o.v << ","
                                      << o.out);
    const AdamBuffers src(n, grad_dtype, param_dtype, 0, /*seed=*/o.master * 31 + o.out);
    AdamBuffers want = src;
    internal::AdamScalarKernel(s, want.Span());
    constexpr size_t kPad = 64;  // floats of slack in front of each array
    auto alloc = [](size_t bytes) {
      return static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    };
    const size_t out_size = DTypeSize(param_dtype);
    char* p = alloc((n + kPad) * 4);
    char* m = alloc((n + kPad) * 4);
    char* v = alloc((n + kPad) * 4);
    char* out = alloc((n + kPad) * out_size);
    float* pf = reinterpret_cast<float*>(p) + o.master;
    float* mf = reinterpret_cast<float*>(m) + o.m;
    float* vf = reinterpret_cast<float*>(v) + o.v;
    char* of = out + o.out * out_size;
    std::memcpy(pf, src.master.data(), n * 4);
    std::memcpy(mf, src.exp_avg.data(), n * 4);
    std::memcpy(vf, src.exp_avg_sq.data(), n * 4);
    std::memset(of, 0, n * out_size);
    variant_.adam(s, AdamSpan{src.grad.data(), grad_dtype, pf, mf, vf, of, param_dtype, n});
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(SameBits(pf[i], want.master[i])) << i;
      ASSERT_TRUE(SameBits(mf[i], want.exp_avg[i])) << i;
      ASSERT_TRUE(SameBits(vf[i], want.exp_avg_sq[i])) << i;
      ASSERT_EQ(0, std::memcmp(of + i * out_size, want.out.data() + i * out_size, out_size)) << i;
    }
    std::free(p);
    std::free(m);
    std::free(v);
    std::free(out);
  }
}

// Compact state: the step equals the fp32 step on the widened moments (same
// p and trainer weight, bit for bit), then m is stored with dtype.h's
// nearest rounding and v with StochasticRoundBF16 of the documented bits.
TEST_P(AdamKernelTest, CompactStateIsTheFp32StepThenTheDocumentedRounding) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  for (size_t n : {size_t{1}, size_t{7}, size_t{22}, size_t{64}, size_t{4099}, (size_t{1} << 16) + 3}) {
    for (bool decoupled : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " decoupled=" << decoupled);
      const size_t offset = n % 3;
      AdamBuffers buf(n, grad_dtype, param_dtype, offset, /*seed=*/n + 17 * decoupled);
      std::vector<uint16_t> m16(n + offset), v16(n + offset);
      for (size_t i = 0; i < n + offset; ++i) {
        m16[i] = FloatToBF16(buf.exp_avg[i]);
        v16[i] = FloatToBF16(buf.exp_avg_sq[i]);
      }
      if (n >= 22) {  // non-finite moments take the NaN / inf paths of every variant
        v16[offset + 3] = 0x7fc1;
        v16[offset + 5] = 0x7f80;
        m16[offset + 7] = 0xffc0;
        v16[offset + 20] = 0x7f7f;  // largest finite bf16: may round up to inf
      }
      for (size_t i = 0; i < n + offset; ++i) {
        buf.exp_avg[i] = BF16ToFloat(m16[i]);
        buf.exp_avg_sq[i] = BF16ToFloat(v16[i]);
      }
      AdamBuffers want = buf;
      const AdamScalars s = MakeAdamScalars(Group(), decoupled, 3, 1024.0, 0.37);
      internal::AdamScalarKernel(s, want.Span());
      AdamSpan compact = buf.Span();
      compact.exp_avg = nullptr;
      compact.exp_avg_sq = nullptr;
      compact.exp_avg_bf16 = m16.data() + offset;
      compact.exp_avg_sq_bf16 = v16.data() + offset;
      compact.element_offset = 1000003 * n;
      variant_.adam(s, compact);
      // NaN payloads may differ between variants (operand order of commutative
      // operations); a NaN must stay NaN.
      auto same = [](uint32_t a, uint32_t b, bool a_nan, bool b_nan) {
        return a == b || (a_nan && b_nan);
      };
      auto bf16_nan = [](uint16_t h) { return (h & 0x7fff) > 0x7f80; };
      for (size_t i = 0; i < n; ++i) {
        const size_t k = i + offset;
        ASSERT_TRUE(same(FloatToBits(buf.master[k]), FloatToBits(want.master[k]),
                         std::isnan(buf.master[k]), std::isnan(want.master[k])))
            << i;
        const uint16_t m_want = FloatToBF16(want.exp_avg[k]);
        const uint16_t v_want = StochasticRoundBF16(
            want.exp_avg_sq[k], RoundingBits(s.rounding_seed, compact.element_offset + i));
        ASSERT_TRUE(same(m16[k], m_want, bf16_nan(m16[k]), bf16_nan(m_want))) << i;
        ASSERT_TRUE(same(v16[k], v_want, bf16_nan(v16[k]), bf16_nan(v_want))) << i;
        if (!std::isnan(want.master[k])) {
          ASSERT_EQ(buf.OutBits(i), want.OutBits(i)) << i;
        }
      }
    }
  }
}

// KeepAdamScalars (a tensor without a gradient this step): p, m, v and the
// trainer's weight come out bit for bit as they went in, for fp32 and
// compact state, with finite gradients of any size and zero moments (where a
// group's eps = 0 would divide 0 by 0).
TEST_P(AdamKernelTest, KeepScalarsLeaveTheStateAsItIs) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  const AdamScalars s = KeepAdamScalars();
  for (size_t n : {size_t{1}, size_t{22}, size_t{4099}}) {
    for (bool compact : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " compact=" << compact);
      AdamBuffers buf(n, grad_dtype, param_dtype, n % 3, /*seed=*/n + 5 * compact);
      std::vector<uint16_t> m16(n + buf.offset), v16(n + buf.offset);
      for (size_t k = 0; k < n + buf.offset; ++k) {
        if (k % 5 == 0) buf.exp_avg[k] = buf.exp_avg_sq[k] = 0.0f;  // never updated yet
        if (compact) {
          m16[k] = FloatToBF16(buf.exp_avg[k]);
          v16[k] = FloatToBF16(buf.exp_avg_sq[k]);
        }
      }
      const AdamBuffers in = buf;
      AdamBuffers ref = buf;  // the scalar kernel writes the weight: the master rounded
      internal::AdamScalarKernel(s, ref.Span());
      AdamSpan span = buf.Span();
      if (compact) {
        span.exp_avg = span.exp_avg_sq = nullptr;
        span.exp_avg_bf16 = m16.data() + buf.offset;
        span.exp_avg_sq_bf16 = v16.data() + buf.offset;
      }
      const std::vector<uint16_t> m16_in = m16, v16_in = v16;
      variant_.adam(s, span);
      for (size_t i = 0; i < n; ++i) {
        const size_t k = i + buf.offset;
        ASSERT_TRUE(SameBits(in.master[k], buf.master[k])) << i;
        ASSERT_TRUE(SameBits(in.master[k], ref.master[k])) << i;
        ASSERT_TRUE(SameBits(in.exp_avg[k], buf.exp_avg[k])) << i;
        ASSERT_TRUE(SameBits(in.exp_avg_sq[k], buf.exp_avg_sq[k])) << i;
        ASSERT_EQ(ref.OutBits(i), buf.OutBits(i)) << i;
        if (compact) {
          ASSERT_EQ(m16[k], m16_in[k]) << i;
          ASSERT_EQ(v16[k], v16_in[k]) << i;
        }
      }
    }
  }
}

std::string Name(const ::testing::TestParamInfo<AdamKernelTest::ParamType>& info) {
  return std::string(std::get<0>(info.param)) + "_grad_" +
         std::string(DTypeName(std::get<1>(info.param))) + "_out_" +
         std::string(DTypeName(std::get<2>(info.param)));
}

// grad_coef (protocol 9: torch's in-place clip after dosd copied the
// gradients): the step on gradients g equals, bit for bit, the scalar
// kernel's step on round_to(grad dtype, float(g) * c) with no coefficient,
// the trainer's multiply first (fp32 math, bf16 rounded to nearest even).
TEST_P(AdamKernelTest, GradCoefIsTheTrainersRoundedMultiplyFirst) {
  const DType grad_dtype = std::get<1>(GetParam());
  const DType param_dtype = std::get<2>(GetParam());
  if (grad_dtype == DType::kF16) {
    GTEST_SKIP() << "fp16 gradients are never scaled (StepExecutor::ScaledCoef)";
  }
  const size_t n = 4096 + 37;  // a masked / scalar tail too
  const float c = 0.3719f;     // not a power of two: the multiply rounds
  AdamBuffers got(n, grad_dtype, param_dtype, 0, /*seed=*/23);
  got.SetGrad(0, 0.0f);
  got.SetGrad(1, -0.0f);
  got.SetGrad(2, 1e-30f);
  got.SetGrad(3, -3e38f);
  AdamBuffers want = got;
  for (size_t i = 0; i < n; ++i) {
    float g;
    if (grad_dtype == DType::kF32) {
      std::memcpy(&g, &got.grad[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &got.grad[i * 2], 2);
      g = BF16ToFloat(h);
    }
    want.SetGrad(i, g * c);  // SetGrad rounds to nearest even into bf16
  }
  const AdamScalars s = MakeAdamScalars(Group(), true, 7, 1.0, 1.0);
  internal::AdamScalarKernel(s, want.Span());
  AdamScalars scaled = s;
  scaled.grad_coef = c;
  variant_.adam(scaled, got.Span());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(SameBits(got.master[i], want.master[i])) << i;
    ASSERT_TRUE(SameBits(got.exp_avg[i], want.exp_avg[i])) << i;
    ASSERT_TRUE(SameBits(got.exp_avg_sq[i], want.exp_avg_sq[i])) << i;
  }
  EXPECT_EQ(got.out, want.out);
}

INSTANTIATE_TEST_SUITE_P(
    AllVariants, AdamKernelTest,
    ::testing::Combine(::testing::Values("scalar", "avx2", "avx512", "avx512bf16", "avx512_ntout",
                                         "avx512_ntall", "avx512bf16_ntout", "avx512bf16_ntall"),
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

TEST(CompactRoundingTest, StochasticRoundingIsUnbiasedAndStaysWithinOneUlp) {
  // x = 1 + 0.3 ulp(bf16): nearest rounding always gives 1.0; stochastic
  // rounding gives 1 + ulp with probability 0.3.
  const float x = BitsToFloat(0x3f800000u + static_cast<uint32_t>(0.3 * 65536));
  double sum = 0;
  constexpr int kN = 200000;
  for (int i = 0; i < kN; ++i) {
    const uint16_t h = StochasticRoundBF16(x, RoundingBits(12345, i));
    ASSERT_TRUE(h == 0x3f80 || h == 0x3f81) << h;
    sum += BF16ToFloat(h);
  }
  EXPECT_NEAR(sum / kN, x, 0.01 * 0x1p-7);  // mean within 1% of an ulp
  EXPECT_EQ(StochasticRoundBF16(1.0f, 0xffff), 0x3f80);  // exact values stay exact
  EXPECT_EQ(StochasticRoundBF16(BitsToFloat(0x7f800000u), 0xffff), 0x7f80);
  EXPECT_EQ(StochasticRoundBF16(BitsToFloat(0x7fc00001u), 0), FloatToBF16(BitsToFloat(0x7fc00001u)));
}

// The reason v is rounded stochastically: with zero gradients v must decay
// as beta2^t. Nearest rounding would keep every v at its start value
// (0.999 v rounds back to v in bf16); stochastic rounding tracks the decay.
TEST(CompactRoundingTest, SecondMomentDecaysLikeFp32) {
  constexpr size_t kN = 4096;
  constexpr int kSteps = 1000;
  std::vector<uint16_t> grad(kN, 0), m16(kN, 0), v16(kN, FloatToBF16(1.0f));
  std::vector<float> master(kN, 1.0f);
  const GroupStepParams group{1e-3, 0.9, 0.999, 1e-8, 0.0};
  for (int step = 1; step <= kSteps; ++step) {
    AdamSpan span{grad.data(), DType::kBF16, master.data(), nullptr, nullptr, nullptr,
                  DType::kBF16, kN};
    span.exp_avg_bf16 = m16.data();
    span.exp_avg_sq_bf16 = v16.data();
    AdamKernel(BestIsa())(MakeAdamScalars(group, true, step, 1.0, 1.0), span);
  }
  double mean = 0;
  for (uint16_t h : v16) mean += BF16ToFloat(h);
  mean /= kN;
  const double want = std::pow(0.999, kSteps);  // 0.368
  EXPECT_NEAR(mean, want, 0.02 * want);
  // Nearest rounding, for contrast, never moves.
  EXPECT_EQ(FloatToBF16(0.999f * 1.0f), FloatToBF16(1.0f));
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
