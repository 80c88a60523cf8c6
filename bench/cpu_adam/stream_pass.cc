#include "bench/cpu_adam/stream_pass.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <algorithm>
#include <cstring>

namespace dos::bench {
namespace {

void StreamTileScalar(const StreamArrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const uint32_t bits = static_cast<uint32_t>(a.grad[i]) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    a.p[i] += x;
    a.m[i] += x;
    a.v[i] += x;
    uint32_t pb;
    std::memcpy(&pb, &a.p[i], 4);
    a.out[i] = static_cast<uint16_t>(pb >> 16);
  }
}

}  // namespace

void StreamPass(tbb::task_arena& arena, const StreamArrays& a, size_t tile_elems) {
  static const auto tile_fn =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
          ? internal::StreamTileAvx512
          : __builtin_cpu_supports("avx2") ? internal::StreamTileAvx2 : StreamTileScalar;
  const size_t tiles = (a.n + tile_elems - 1) / tile_elems;
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) {
            tile_fn(a, t * tile_elems, std::min(a.n, (t + 1) * tile_elems));
          }
        },
        tbb::static_partitioner());
  });
}

}  // namespace dos::bench
