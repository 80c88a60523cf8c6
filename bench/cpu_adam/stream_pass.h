// The benchmark's host-memory yardstick: a STREAM-like pass with the Adam
// kernel's access pattern and byte count but (almost) no arithmetic. Per
// element it reads a bf16 gradient and the fp32 p, m, v, and writes p, m, v
// back plus a bf16 weight: 4 streams read, 4 written, 28 bytes, exactly what
// the kernel moves for bf16 gradients and bf16 weights. Not thread-safe per
// call: run it from one thread; it parallelises inside the given arena.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <cstddef>
#include <cstdint>

namespace dos::bench {

struct StreamArrays {
  const uint16_t* grad;
  float* p;
  float* m;
  float* v;
  uint16_t* out;
  size_t n;
};

inline constexpr size_t kStreamBytesPerElement = 2 + 12 + 12 + 2;

// One pass over all n elements, tiled like CpuUpdater (static partition).
void StreamPass(tbb::task_arena& arena, const StreamArrays& a, size_t tile_elems);

namespace internal {
void StreamTileAvx2(const StreamArrays& a, size_t begin, size_t end);
void StreamTileAvx512(const StreamArrays& a, size_t begin, size_t end);
}  // namespace internal

}  // namespace dos::bench
