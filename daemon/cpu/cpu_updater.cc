#include "daemon/cpu/cpu_updater.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>


namespace dos::cpu {
namespace {

// Tile boundaries fall on multiples of this many fp32 elements of the master
// array's address (128 bytes).
constexpr size_t kAlignElems = 32;

int ResolveThreads(int requested) {
  return requested > 0 ? requested : tbb::info::default_concurrency();
}

size_t RoundTile(size_t tile_elems) {
  const size_t t = std::max(tile_elems, kAlignElems);
  return (t + kAlignElems - 1) / kAlignElems * kAlignElems;
}

Isa ResolveIsa(Isa isa) { return IsaSupported(isa) ? isa : Isa::kScalar; }

// Elements of the master array before its next 128-byte boundary, seen as
// the offset of element 0 within its 32-element line pair.
size_t Phase(const float* master) {
  return (reinterpret_cast<uintptr_t>(master) / sizeof(float)) % kAlignElems;
}

// oneTBB reports allocation failures and internal errors by throwing. The
// daemon cannot undo a half-applied optimizer step, so there is nothing to
// return to: report and abort rather than let an exception cross project
// code. The line follows log.h's format but is written directly: dos_cpu
// stays free of abseil so that its benchmark ships with libtbb alone.
template <typename Fn>
void CallNoThrow(const char* what, const Fn& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "level=error event=cpu.tbb_exception in=%s what=\"%s\"\n", what,
                 e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "level=error event=cpu.tbb_exception in=%s what=unknown\n", what);
    std::abort();
  }
}

}  // namespace

// How the arena's threads run while they work in it, set on entry and
// undone on exit (TBB workers move between arenas):
//   pin   arena slot i on cpus_[i % size]; a thread that is not one of TBB's
//         workers (the caller of Run) gets its own mask back on exit, so
//         pinning never leaks into the daemon's other threads;
//   nice  TBB workers at this nice value, their own given back on exit; the
//         caller of Run (a session's step thread) is left as it is.
// A failed affinity or priority call (a restricted container) leaves the
// thread as it was: both are hints, not correctness conditions.
class CpuUpdater::WorkerSetup : public tbb::task_scheduler_observer {
 public:
  WorkerSetup(tbb::task_arena& arena, bool pin, int nice)
      : tbb::task_scheduler_observer(arena), nice_(nice) {
    cpu_set_t mask;
    CPU_ZERO(&mask);
    if (pin && sched_getaffinity(0, sizeof mask, &mask) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &mask)) cpus_.push_back(c);
      }
    }
    observe(true);
  }
  ~WorkerSetup() override { observe(false); }

  void on_scheduler_entry(bool is_worker) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (!cpus_.empty() && slot >= 0) {
      if (!is_worker) {
        mask_saved_ = pthread_getaffinity_np(pthread_self(), sizeof mask_, &mask_) == 0;
      }
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus_[static_cast<size_t>(slot) % cpus_.size()], &one);
      pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    }
    if (nice_ != 0 && is_worker) {
      const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
      errno = 0;
      const int before = getpriority(PRIO_PROCESS, tid);
      if (errno == 0) {
        nice_saved_ = setpriority(PRIO_PROCESS, tid, nice_) == 0;
        nice_before_ = before;
      }
    }
  }
  void on_scheduler_exit(bool is_worker) override {
    if (!is_worker && mask_saved_) {
      pthread_setaffinity_np(pthread_self(), sizeof mask_, &mask_);
      mask_saved_ = false;
    }
    if (is_worker && nice_saved_) {
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice_before_);
      nice_saved_ = false;
    }
  }

 private:
  std::vector<int> cpus_;  // empty: no pinning
  const int nice_;         // 0: nice values left alone
  // The thread's own mask and nice value while it is inside the arena.
  static thread_local cpu_set_t mask_;
  static thread_local bool mask_saved_;
  static thread_local int nice_before_;
  static thread_local bool nice_saved_;
};

thread_local cpu_set_t CpuUpdater::WorkerSetup::mask_;
thread_local bool CpuUpdater::WorkerSetup::mask_saved_ = false;
thread_local int CpuUpdater::WorkerSetup::nice_before_ = 0;
thread_local bool CpuUpdater::WorkerSetup::nice_saved_ = false;

CpuUpdater::CpuUpdater(const CpuUpdaterOptions& options)
    : threads_(ResolveThreads(options.threads)),
      tile_elems_(RoundTile(options.tile_elems)),
      isa_(ResolveIsa(options.isa)),
      stores_(options.stores),
      kernel_(AdamKernel(isa_, stores_)),
      all_finite_(AllFiniteKernel(isa_)),
      arena_(threads_, /*reserved_for_masters=*/1) {
  CallNoThrow("arena.initialize", [&] {
    arena_.initialize();
    if (options.pin_threads || options.worker_nice != 0) {
      setup_ = std::make_unique<WorkerSetup>(arena_, options.pin_threads, options.worker_nice);
    }
  });
}

CpuUpdater::~CpuUpdater() = default;

size_t CpuUpdater::CountTiles(std::span<const Item> items, std::vector<size_t>* tile_start) const {
  tile_start->resize(items.size() + 1);
  size_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    (*tile_start)[i] = total;
    const AdamSpan& s = items[i].span;
    if (s.n > 0) total += (s.n + Phase(s.master) + tile_elems_ - 1) / tile_elems_;
  }
  (*tile_start)[items.size()] = total;
  return total;
}

CpuUpdater::Tile CpuUpdater::TileAt(std::span<const Item> items,
                                    const std::vector<size_t>& tile_start, size_t tile) const {
  // The item whose tile range holds `tile` (items with no tiles are skipped
  // because upper_bound lands past equal starts).
  const auto it = std::upper_bound(tile_start.begin(), tile_start.end(), tile);
  const size_t item = static_cast<size_t>(it - tile_start.begin()) - 1;
  const AdamSpan& s = items[item].span;
  const size_t k = tile - tile_start[item];
  const size_t phase = Phase(s.master);
  const size_t begin = k == 0 ? 0 : k * tile_elems_ - phase;
  const size_t end = std::min(s.n, (k + 1) * tile_elems_ - phase);
  return {item, begin, end};
}

template <typename Fn>
void CpuUpdater::ForEachTile(std::span<const Item> items, const Fn& fn) {
  std::vector<size_t> tile_start;
  const size_t total = CountTiles(items, &tile_start);
  if (total == 0) return;
  CallNoThrow("parallel_for", [&] {
    arena_.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, total, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t t = r.begin(); t != r.end(); ++t) fn(TileAt(items, tile_start, t));
          },
          tbb::static_partitioner());
    });
  });
}

namespace {

AdamSpan SubSpan(const AdamSpan& s, size_t begin, size_t end) {
  AdamSpan out = s;
  out.grad = static_cast<const char*>(s.grad) + begin * DTypeSize(s.grad_dtype);
  out.master = s.master + begin;
  if (IsCompact(s)) {
    out.exp_avg_bf16 = s.exp_avg_bf16 + begin;
    out.exp_avg_sq_bf16 = s.exp_avg_sq_bf16 + begin;
  } else {
    out.exp_avg = s.exp_avg + begin;
    out.exp_avg_sq = s.exp_avg_sq + begin;
  }
  out.element_offset = s.element_offset + begin;
  if (s.param_out != nullptr) {
    out.param_out = static_cast<char*>(s.param_out) + begin * DTypeSize(s.param_dtype);
  }
  out.n = end - begin;
  return out;
}

}  // namespace

void CpuUpdater::Run(std::span<const Item> items) { RunKernel(kernel_, items); }

void CpuUpdater::RunKernel(AdamKernelFn kernel, std::span<const Item> items) {
  ForEachTile(items, [&](const Tile& t) {
    const Item& item = items[t.item];
    kernel(item.scalars, SubSpan(item.span, t.begin, t.end));
  });
}

void CpuUpdater::FirstTouch(std::span<const Item> items) {
  ForEachTile(items, [&](const Tile& t) {
    const AdamSpan& s = items[t.item].span;
    const size_t n = t.end - t.begin;
    std::memset(s.master + t.begin, 0, n * sizeof(float));
    if (IsCompact(s)) {
      std::memset(s.exp_avg_bf16 + t.begin, 0, n * sizeof(uint16_t));
      std::memset(s.exp_avg_sq_bf16 + t.begin, 0, n * sizeof(uint16_t));
    } else {
      std::memset(s.exp_avg + t.begin, 0, n * sizeof(float));
      std::memset(s.exp_avg_sq + t.begin, 0, n * sizeof(float));
    }
  });
}

bool CpuUpdater::AllFinite(std::span<const GradRun> runs) {
  // Chunks of 4 tiles: the scan moves 2-4 bytes per element, not ~30.
  const size_t chunk = tile_elems_ * 4;
  std::vector<size_t> chunk_start(runs.size() + 1);
  size_t total = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    chunk_start[i] = total;
    total += (runs[i].n + chunk - 1) / chunk;
  }
  chunk_start[runs.size()] = total;
  if (total == 0) return true;
  std::atomic<bool> found_non_finite{false};
  CallNoThrow("parallel_for", [&] {
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, total, 1),
                        [&](const tbb::blocked_range<size_t>& r) {
                          for (size_t c = r.begin(); c != r.end(); ++c) {
                            if (found_non_finite.load(std::memory_order_relaxed)) return;
                            const auto it =
                                std::upper_bound(chunk_start.begin(), chunk_start.end(), c);
                            const size_t i = static_cast<size_t>(it - chunk_start.begin()) - 1;
                            const GradRun& run = runs[i];
                            const size_t begin = (c - chunk_start[i]) * chunk;
                            const size_t n = std::min(chunk, run.n - begin);
                            const char* g = static_cast<const char*>(run.grad) +
                                            begin * DTypeSize(run.dtype);
                            if (!all_finite_(g, run.dtype, n)) {
                              found_non_finite.store(true, std::memory_order_relaxed);
                            }
                          }
                        });
    });
  });
  return !found_non_finite.load(std::memory_order_relaxed);
}

}  // namespace dos::cpu
