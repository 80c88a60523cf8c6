// CpuUpdater: runs the Adam kernel over many contiguous runs, tiled, on a
// oneTBB task_arena of a configured size. It owns the arena; callers own
// every buffer the items point to and must keep them alive and unaliased
// (except param_out == master for fp32 weights) until the call returns.
//
// Thread-safety: every method may be called from several threads at once
// (one per session); calls share the arena's threads and each returns when
// its own work is done.
//
// Tiling: a run is cut into tiles of tile_elems elements whose boundaries
// sit on 128-byte boundaries of the master array (32 fp32 elements, so the
// 16-bit arrays of the same alignment break on whole 64-byte lines too): no
// two threads write the same cache line. Tiles are handed out by a static
// partition (contiguous ranges of the tile list, in order, per arena slot),
// so FirstTouch() over the same item list places each page on the memory
// node of the thread that later updates it.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "daemon/cpu/adam_kernel.h"

namespace dos::cpu {

struct CpuUpdaterOptions {
  // Arena threads, the calling thread included; 0 = every core TBB sees.
  int threads = 0;
  // Elements per tile: 64Ki elements are 768 KiB of fp32 state plus 128-256
  // KiB of gradient and weight, about one core's L2. Rounded up to a
  // multiple of 32.
  size_t tile_elems = 65536;
  // Kernel variant; an ISA this CPU lacks falls back to the scalar kernel
  // (isa() says which one runs: the caller logs it, dos_cpu does not log).
  Isa isa = BestIsa();
  // Non-temporal stores for the results (see Stores in adam_kernel.h).
  // kStreamOut: measured 10-20% faster than kCached on nvidia-h200 at 16
  // threads (the 2-byte weight stream skips its read-for-ownership, 30 -> 28
  // bytes of DRAM traffic); kStreamAll was slower (bench/cpu_adam/README.md).
  Stores stores = Stores::kStreamOut;
  // Pin arena slot i to the i-th allowed CPU while it works in the arena
  // (a calling thread gets its own affinity back when it leaves).
  bool pin_threads = false;
  // Nice value (1-19) of the arena's TBB workers while they work in it (0:
  // left as they are). The delayed update's arena runs beside the trainers'
  // launch threads: niced, the kernel scheduler runs a trainer's thread
  // first whenever both want a core. A worker gets its own value back when
  // it leaves (TBB's workers move between arenas).
  int worker_nice = 0;
};

class CpuUpdater {
 public:
  explicit CpuUpdater(const CpuUpdaterOptions& options);
  ~CpuUpdater();
  CpuUpdater(const CpuUpdater&) = delete;
  CpuUpdater& operator=(const CpuUpdater&) = delete;

  // One work item per contiguous run.
  struct Item {
    AdamScalars scalars;
    AdamSpan span;
  };
  // Runs every item, tiled, in parallel in the arena; blocks until done.
  void Run(std::span<const Item> items);
  // Run() with another function in place of the Adam kernel, over the same
  // tiles, threads and partition: for benchmarks' memory yardsticks.
  void RunKernel(AdamKernelFn kernel, std::span<const Item> items);

  // Writes zeros to master, exp_avg and exp_avg_sq (or the compact bf16
  // moments) of every item with the
  // tile partition Run() uses for the same list, so that freshly mapped pages
  // are first touched (and placed) by the threads that will update them. Call
  // it before filling or pinning the state (cudaHostRegister touches pages).
  void FirstTouch(std::span<const Item> items);

  // Parallel non-finite scan over many gradient runs; true if all finite.
  struct GradRun {
    const void* grad;
    DType dtype;
    size_t n;
  };
  bool AllFinite(std::span<const GradRun> runs);

  int threads() const { return threads_; }
  Isa isa() const { return isa_; }
  Stores stores() const { return stores_; }
  size_t tile_elems() const { return tile_elems_; }

 private:
  struct Tile {
    size_t item;
    size_t begin;
    size_t end;
  };
  // tile_start[i] is the index of item i's first tile; the last entry is the
  // total. Returns the total.
  size_t CountTiles(std::span<const Item> items, std::vector<size_t>* tile_start) const;
  Tile TileAt(std::span<const Item> items, const std::vector<size_t>& tile_start,
              size_t tile) const;
  // Runs fn(Tile) for every tile in the arena with the static partition.
  template <typename Fn>
  void ForEachTile(std::span<const Item> items, const Fn& fn);

  const int threads_;
  const size_t tile_elems_;
  const Isa isa_;
  const Stores stores_;
  const AdamKernelFn kernel_;
  const AllFiniteFn all_finite_;
  tbb::task_arena arena_;
  class WorkerSetup;
  std::unique_ptr<WorkerSetup> setup_;  // set when pin_threads or worker_nice
};

}  // namespace dos::cpu
