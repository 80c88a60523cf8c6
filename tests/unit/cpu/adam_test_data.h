// Test-only helpers: random Adam state and gradients in every dtype, and
// owned buffers an AdamSpan can point into (at an element offset, so that
// vector variants see unaligned starts).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu::testing {

struct AdamBuffers {
  AdamBuffers(size_t n, DType grad_dtype, DType param_dtype, size_t offset, uint64_t seed)
      : n(n), offset(offset), grad_dtype(grad_dtype), param_dtype(param_dtype) {
    grad.resize((n + offset) * DTypeSize(grad_dtype));
    master.resize(n + offset);
    exp_avg.resize(n + offset);
    exp_avg_sq.resize(n + offset);
    out.assign((n + offset) * DTypeSize(param_dtype), 0);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> decade(-6, 1);
    for (size_t i = 0; i < n + offset; ++i) {
      // Weights over several decades, so bf16/fp16 rounding and the update
      // term both matter; moments consistent with earlier steps.
      master[i] = normal(rng) * std::pow(10.0f, static_cast<float>(decade(rng)));
      const float g = normal(rng) * 1e-2f;
      exp_avg[i] = 0.1f * g + 1e-3f * normal(rng);
      exp_avg_sq[i] = 1e-4f * normal(rng) * normal(rng) + 1e-4f * g * g * 100.0f;
      exp_avg_sq[i] = std::fabs(exp_avg_sq[i]);
      SetGrad(i, normal(rng) * 1e-2f * 1024.0f);  // as if scaled by a 1024 loss scale
    }
  }

  void SetGrad(size_t i, float g) {
    switch (grad_dtype) {
      case DType::kF32: std::memcpy(&grad[i * 4], &g, 4); break;
      case DType::kBF16: {
        const uint16_t h = FloatToBF16(g);
        std::memcpy(&grad[i * 2], &h, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = FloatToF16(g);
        std::memcpy(&grad[i * 2], &h, 2);
        break;
      }
    }
  }

  AdamSpan Span(bool write_out = true) {
    return AdamSpan{grad.data() + offset * DTypeSize(grad_dtype),
                    grad_dtype,
                    master.data() + offset,
                    exp_avg.data() + offset,
                    exp_avg_sq.data() + offset,
                    write_out ? out.data() + offset * DTypeSize(param_dtype) : nullptr,
                    param_dtype,
                    n};
  }

  // Bits of the trainer weight i (0-based in the span).
  uint32_t OutBits(size_t i) const {
    const size_t k = i + offset;
    if (param_dtype == DType::kF32) {
      uint32_t u;
      std::memcpy(&u, &out[k * 4], 4);
      return u;
    }
    uint16_t h;
    std::memcpy(&h, &out[k * 2], 2);
    return h;
  }

  size_t n, offset;
  DType grad_dtype, param_dtype;
  std::vector<char> grad;
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<char> out;
};

inline uint32_t RoundBits(DType dtype, float p) {
  switch (dtype) {
    case DType::kF32: return FloatToBits(p);
    case DType::kBF16: return FloatToBF16(p);
    case DType::kF16: return FloatToF16(p);
  }
  return 0;
}

}  // namespace dos::cpu::testing
