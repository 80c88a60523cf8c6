// The compact state's stochastic rounding (daemon/cpu/stochastic_round.h):
// pinned values of the one scalar definition, which the CPU and the GPU
// kernels share, and the AVX2 and AVX-512 kernels' own 8- and 16-lane copies
// against it on random inputs.
#include "daemon/cpu/stochastic_round.h"

#include <cstdint>
#include <random>

#include "daemon/cpu/kernel_variants.h"
#include "gtest/gtest.h"

namespace dos::cpu {
namespace {

// Values of the function as it shipped when compact state was introduced:
// changing them changes every compact run's bits (and the GPU's with them).
TEST(StochasticRoundTest, RoundingBitsArePinned) {
  EXPECT_EQ(RoundingBits(0, 0), 0x0000u);
  EXPECT_EQ(RoundingBits(12345, 7), 0x7277u);
  EXPECT_EQ(RoundingBits(0xdeadbeefu, (uint64_t{1} << 40) + 5), 0x8f24u);  // low 32 bits only
  EXPECT_EQ(RoundingBits(0xffffffffu, 0xffffffffu), 0x24c2u);
  const uint32_t bits = RoundingBits(42, 3);
  EXPECT_EQ(StochasticRoundBF16(0x1p+0f, bits), 0x3f80u);
  EXPECT_EQ(StochasticRoundBF16(0x1.99999ap-4f, bits), 0x3dcdu);
  EXPECT_EQ(StochasticRoundBF16(-0x1.4a90cep-65f, bits), 0x9f25u);
  EXPECT_EQ(StochasticRoundBF16(0x1.16c2p-133f, bits), 0x0001u);  // subnormal
}

// Random bit patterns (NaNs, infinities, subnormals and signs included),
// random seeds and starting indices anywhere in 64 bits (the lanes' 32-bit
// index arithmetic wraps as the scalar's truncation does).
template <size_t kLanes>
void ExpectVectorMatchesScalar(void (*vector)(uint32_t, uint64_t, const float*, uint16_t*)) {
  std::mt19937_64 rng(20261130);
  for (int round = 0; round < 20000; ++round) {
    const uint32_t seed = static_cast<uint32_t>(rng());
    uint64_t index0 = rng();
    if (round % 4 == 0) index0 = 0xffffffffu - rng() % kLanes;  // lanes cross 2^32
    float x[kLanes];
    for (size_t i = 0; i < kLanes; ++i) {
      const uint32_t u = static_cast<uint32_t>(rng());
      // Half the lanes: ordinary positive values near 1 (the usual v).
      x[i] = round % 2 == 0 ? BitsToFloat(u) : BitsToFloat(0x3f000000u | (u & 0x00ffffffu));
    }
    if (round % 8 == 1) x[rng() % kLanes] = BitsToFloat(0x7fc00001u);  // a NaN lane
    uint16_t got[kLanes];
    vector(seed, index0, x, got);
    for (size_t i = 0; i < kLanes; ++i) {
      ASSERT_EQ(got[i], StochasticRoundBF16(x[i], RoundingBits(seed, index0 + i)))
          << "lane " << i << " of round " << round << ": x bits 0x" << std::hex
          << FloatToBits(x[i]) << " seed 0x" << seed << " index 0x" << index0 + i;
    }
  }
}

TEST(StochasticRoundTest, Avx2MatchesScalar) {
  if (!IsaSupported(Isa::kAvx2)) GTEST_SKIP() << "this CPU has no AVX2";
  ExpectVectorMatchesScalar<8>(internal::StochasticRoundAvx2);
}

TEST(StochasticRoundTest, Avx512MatchesScalar) {
  if (!IsaSupported(Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512 (F, BW, VL, DQ)";
  ExpectVectorMatchesScalar<16>(internal::StochasticRoundAvx512);
}

}  // namespace
}  // namespace dos::cpu
