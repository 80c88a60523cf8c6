// AllFinite of every variant: finite data (including -0, subnormals and the
// largest finite value) passes; one inf, -inf or NaN at the first, a middle
// or the last position fails, for every dtype and awkward size.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "daemon/cpu/kernel_variants.h"
#include "gtest/gtest.h"

namespace dos::cpu {
namespace {

std::vector<char> FiniteData(DType dtype, size_t n, uint64_t seed) {
  std::vector<char> data(n * DTypeSize(dtype));
  std::mt19937_64 rng(seed);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-45f, std::numeric_limits<float>::max(),
                            -65504.0f, 3.0f};
  for (size_t i = 0; i < n; ++i) {
    float f = std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng);
    if (i % 5 == 0) f = specials[(i / 5) % 7];
    if (dtype == DType::kF32) {
      std::memcpy(&data[i * 4], &f, 4);
    } else {
      uint16_t h = dtype == DType::kBF16 ? FloatToBF16(f) : FloatToF16(f);
      // max() overflows to inf in both 16-bit types: use their largest finite.
      if (dtype == DType::kF16 && (h & 0x7c00) == 0x7c00) h = 0x7bff;
      if (dtype == DType::kBF16 && (h & 0x7f80) == 0x7f80) h = 0x7f7f;
      std::memcpy(&data[i * 2], &h, 2);
    }
  }
  return data;
}

void Poke(std::vector<char>* data, DType dtype, size_t i, float f) {
  if (dtype == DType::kF32) {
    std::memcpy(&(*data)[i * 4], &f, 4);
  } else {
    const uint16_t h = dtype == DType::kBF16 ? FloatToBF16(f) : FloatToF16(f);
    std::memcpy(&(*data)[i * 2], &h, 2);
  }
}

TEST(AllFiniteTest, EveryVariantDtypeSizeAndPosition) {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), BitsToFloat(0xff800001)};
  for (const internal::KernelVariant& k : internal::SupportedKernelVariants()) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (size_t n : {size_t{1}, size_t{7}, size_t{22}, size_t{64}, size_t{4097},
                       (size_t{1} << 20) + 3}) {
        SCOPED_TRACE(::testing::Message() << k.name << " " << DTypeName(dtype) << " n=" << n);
        std::vector<char> data = FiniteData(dtype, n, n);
        ASSERT_TRUE(k.all_finite(data.data(), dtype, n));
        ASSERT_TRUE(k.all_finite(data.data(), dtype, 0));
        for (size_t pos : {size_t{0}, n / 2, n - 1}) {
          for (float f : bad) {
            std::vector<char> copy = data;
            Poke(&copy, dtype, pos, f);
            ASSERT_FALSE(k.all_finite(copy.data(), dtype, n)) << "pos=" << pos << " f=" << f;
            // The element just outside the scanned range must not count.
            if (pos == n - 1 && n > 1) {
              ASSERT_TRUE(k.all_finite(copy.data(), dtype, n - 1));
            }
          }
        }
      }
    }
  }
}

TEST(AllFiniteTest, PublicEntryPoint) {
  std::vector<float> g(100, 1.0f);
  EXPECT_TRUE(AllFinite(g.data(), DType::kF32, g.size()));
  g[99] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(AllFinite(g.data(), DType::kF32, g.size()));
}

}  // namespace
}  // namespace dos::cpu
