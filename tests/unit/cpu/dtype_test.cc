// dos/wire/dtype.h's conversions against independent implementations:
// decoding by ldexp, rounding by comparing distances to both neighbours
// (bf16) or by nearbyint on the exact quotient in double (fp16). Every tie,
// subnormal, overflow and NaN pattern is covered exhaustively over the upper
// bits, plus millions of random floats.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "dos/wire/dtype.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

// bf16 bits -> value, treating exponent 255 as an ordinary binade (2^128 for
// 0x7f80) so that the rounding reference can measure distances to it.
double DecodeBF16Extended(uint16_t h) {
  const int exp = (h >> 7) & 0xff;
  const int man = h & 0x7f;
  const double mag = exp == 0 ? std::ldexp(man, -133) : std::ldexp(128 + man, exp - 134);
  return (h & 0x8000) ? -mag : mag;
}

uint16_t ReferenceFloatToBF16(float f) {
  const uint32_t u = FloatToBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  if (std::isinf(f)) return static_cast<uint16_t>(u >> 16);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);   // away from zero (may be inf)
  const double x = std::fabs(static_cast<double>(f));
  const double d_lo = x - std::fabs(DecodeBF16Extended(lo));
  const double d_hi = std::fabs(DecodeBF16Extended(hi)) - x;
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1) ? hi : lo;
}

double DecodeF16(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  double mag;
  if (exp == 0x1f) {
    mag = man == 0 ? std::numeric_limits<double>::infinity()
                   : std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(man, -24);
  } else {
    mag = std::ldexp(1024 + man, exp - 25);
  }
  return (h & 0x8000) ? -mag : mag;
}

uint16_t ReferenceFloatToF16(float f) {
  const uint16_t sign = (FloatToBits(f) >> 16) & 0x8000;
  if (std::isnan(f)) return sign | 0x7e00;
  const double x = std::fabs(static_cast<double>(f));
  if (x >= 65520.0) return sign | 0x7c00;  // halfway above 65504 and beyond
  if (x == 0.0) return sign;
  int e2;
  std::frexp(x, &e2);  // x = frac * 2^e2, frac in [0.5, 1): exponent e2 - 1
  const int e = std::max(e2 - 1, -14);
  // x / 2^(e-10) is exact in double; nearbyint rounds half to even.
  const double r = std::nearbyint(std::ldexp(x, 10 - e));
  // Normal and subnormal share this encoding, carries included.
  return sign | static_cast<uint16_t>(((e + 15) << 10) + static_cast<int>(r) - 1024);
}

TEST(DTypeTest, F16ToFloatExhaustive) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = F16ToFloat(static_cast<uint16_t>(h));
    const double want = DecodeF16(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      // Payload and sign carried over, as a widening conversion does.
      ASSERT_EQ(FloatToBits(got), ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13));
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(DTypeTest, BF16ToFloatExhaustive) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(FloatToBits(BF16ToFloat(static_cast<uint16_t>(h))), h << 16);
  }
}

// Low halves that exercise truncation, exact ties and just-above/below ties.
std::vector<uint32_t> InterestingLowBits(uint32_t tie_bit, std::mt19937* rng) {
  const uint32_t all = tie_bit * 2 - 1;
  const uint32_t r1 = static_cast<uint32_t>((*rng)()) & all;
  const uint32_t r2 = static_cast<uint32_t>((*rng)()) & all;
  return {0, 1, tie_bit - 1, tie_bit, tie_bit + 1, all, r1, r2};
}

void ExpectBF16(uint32_t u) {
  const float f = BitsToFloat(u);
  ASSERT_EQ(FloatToBF16(f), ReferenceFloatToBF16(f)) << std::hex << "bits=" << u;
}

void ExpectF16(uint32_t u) {
  const float f = BitsToFloat(u);
  ASSERT_EQ(FloatToF16(f), ReferenceFloatToF16(f)) << std::hex << "bits=" << u;
}

TEST(DTypeTest, FloatToBF16EveryUpperHalfAndTie) {
  std::mt19937 rng(1);
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : InterestingLowBits(0x8000, &rng)) ExpectBF16((hi << 16) | lo);
  }
}

TEST(DTypeTest, FloatToBF16Random) {
  std::mt19937 rng(2);
  for (int i = 0; i < 10'000'000; ++i) ExpectBF16(rng());
}

TEST(DTypeTest, FloatToF16EveryUpperBitsAndTie) {
  std::mt19937 rng(3);
  for (uint32_t hi = 0; hi < (1u << 19); ++hi) {
    for (uint32_t lo : InterestingLowBits(0x1000, &rng)) ExpectF16((hi << 13) | lo);
  }
}

TEST(DTypeTest, FloatToF16Random) {
  std::mt19937 rng(4);
  for (int i = 0; i < 10'000'000; ++i) ExpectF16(rng());
}

TEST(DTypeTest, NamedCases) {
  // Ties to even, both directions.
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x3f808000)), 0x3f80);  // 1 + 2^-8: tie, stays even
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x3f818000)), 0x3f82);  // odd: rounds up
  EXPECT_EQ(FloatToF16(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(FloatToF16(1.0f + 3 * 0x1p-11f), 0x3c02);
  // Overflow: largest finite bf16 plus just under half an ulp stays finite.
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x7f7f7fff)), 0x7f7f);
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x7f7f8000)), 0x7f80);
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToF16(-1e10f), 0xfc00);
  // Subnormals.
  EXPECT_EQ(FloatToF16(0x1p-24f), 0x0001);
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);             // tie to even (zero)
  EXPECT_EQ(FloatToF16(0x1p-25f * 3), 0x0002);          // 1.5 ulp: tie to even (2)
  EXPECT_EQ(FloatToF16(-0x1p-14f + 0x1p-25f), 0x8400);  // rounds up into the normals
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x00000001)), 0x0000);
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x00008001)), 0x0001);
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x80018000)), 0x8002);
  // Infinities and NaN.
  EXPECT_EQ(FloatToBF16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x7f800001)), 0x7fc0);  // signalling NaN is quieted
  EXPECT_EQ(FloatToBF16(BitsToFloat(0xffffffff)), 0xffff);
  EXPECT_EQ(FloatToF16(BitsToFloat(0xff800001)), 0xfe00);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::nanf("")))));
}

}  // namespace
}  // namespace dos
