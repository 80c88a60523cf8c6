// Element types of trainer tensors and scalar conversions between them.
//
// The numeric values of DType are part of the wire contract: they match
// dos.v1.DType in proto/dos/v1/dos.proto and DOS_DTYPE_* in
// client/include/dos/dos.h. Conversions to 16-bit round to nearest, ties to
// even, as PyTorch's .to(torch.bfloat16 / torch.float16) does; NaN stays NaN
// and overflow becomes infinity.
#pragma once

#include <cstdint>
#include <cstring>
#include "absl/strings/string_view.h"

namespace dos {

enum class DType : uint32_t { kF32 = 1, kBF16 = 2, kF16 = 3 };

inline constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
absl::string_view DTypeName(DType t);
// True for the three values above; anything else from the wire is invalid.
bool IsValidDType(uint32_t raw);

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BF16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBF16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into inf
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // Zero or subnormal: value = man * 2^-24, exact in float.
    float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t FloatToF16(float f) {
  uint32_t u = FloatToBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;       // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;      // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero) in f16: value / 2^-24 rounded to nearest even.
    // Adding 0.5f (2^-1) aligns the mantissa so float addition does the rounding.
    float mag = BitsToFloat(a) + 0.5f;
    return sign | static_cast<uint16_t>(FloatToBits(mag) - 0x3f000000u);
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(a >> 13);
}

}  // namespace dos
