// What the GPU tests and their trainer processes share: a device's UUID as
// dosd names it, and the deterministic tensor contents both the CPU-mode
// reference and the GPU-mode session start from.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "dos/dos.h"
#include "dos/wire/dtype.h"

namespace dos::testing {

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of CUDA device `device`; "" if
// CUDA cannot say.
inline std::string DeviceUuid(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof text,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  return text;
}

// One test tensor: its dtype (weights and gradients alike) and size.
struct Layout {
  dos_dtype dtype;
  uint64_t numel;
};

inline uint64_t Bytes(const Layout& l) { return l.numel * DTypeSize(static_cast<DType>(l.dtype)); }

// Hashed values in [-scale/2, scale/2), in the layout's dtype, into `out`.
inline void FillValues(const Layout& l, uint32_t seed, float scale, char* out) {
  for (uint64_t i = 0; i < l.numel; ++i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ (seed * 0x9e3779b9u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float f = (static_cast<float>(h & 0xffffff) / 16777216.0f - 0.5f) * scale;
    if (l.dtype == DOS_DTYPE_F32) {
      std::memcpy(out + 4 * i, &f, 4);
    } else {
      const uint16_t b = l.dtype == DOS_DTYPE_BF16 ? FloatToBF16(f) : FloatToF16(f);
      std::memcpy(out + 2 * i, &b, 2);
    }
  }
}

}  // namespace dos::testing
