// CpuUpdater: tiled parallel runs equal the kernel run serially, bit for bit
// (Adam is not idempotent, so a tile run twice or skipped shows up), also
// with concurrent callers; AllFinite over many runs; FirstTouch.
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/cpu/cpu_updater.h"
#include "gtest/gtest.h"
#include "tests/unit/cpu/adam_test_data.h"

namespace dos::cpu {
namespace {

using testing::AdamBuffers;

struct Workload {
  std::vector<std::unique_ptr<AdamBuffers>> buffers;
  std::vector<CpuUpdater::Item> items;
};

// Runs of assorted sizes (including empty ones and ones smaller than a
// tile), dtypes and misalignments, with per-run scalars.
Workload MakeWorkload(uint64_t seed) {
  Workload w;
  const size_t sizes[] = {1, 0, 7, 300000, 64, 22, 70001, 4096, 12345, 0, 99, (1u << 18) + 3};
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    w.buffers.push_back(std::make_unique<AdamBuffers>(sizes[i], dtypes[i % 3], dtypes[(i / 3) % 3],
                                                      /*offset=*/i % 5, seed + i));
    const GroupStepParams group{1e-3 * (i + 1), 0.9, 0.999, 1e-8, 0.01};
    w.items.push_back({MakeAdamScalars(group, i % 2 == 0, 1 + i, 8.0, 0.5),
                       w.buffers.back()->Span(/*write_out=*/i != 5)});
  }
  return w;
}

void ExpectSameState(const Workload& a, const Workload& b) {
  for (size_t r = 0; r < a.buffers.size(); ++r) {
    const AdamBuffers& x = *a.buffers[r];
    const AdamBuffers& y = *b.buffers[r];
    ASSERT_EQ(std::memcmp(x.master.data(), y.master.data(), x.master.size() * 4), 0) << r;
    ASSERT_EQ(std::memcmp(x.exp_avg.data(), y.exp_avg.data(), x.exp_avg.size() * 4), 0) << r;
    ASSERT_EQ(std::memcmp(x.exp_avg_sq.data(), y.exp_avg_sq.data(), x.exp_avg_sq.size() * 4), 0)
        << r;
    ASSERT_EQ(x.out, y.out) << r;
  }
}

void RunSerially(const Workload& w, Isa isa) {
  for (const CpuUpdater::Item& item : w.items) AdamKernel(isa)(item.scalars, item.span);
}

TEST(CpuUpdaterTest, EqualsSerialKernelForEveryIsaAndTileSize) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) {
      std::printf("skipping %s: this CPU lacks it\n", std::string(IsaName(isa)).c_str());
      continue;
    }
    for (size_t tile : {size_t{1}, size_t{100}, size_t{4096}, size_t{65536}}) {
      SCOPED_TRACE(::testing::Message() << IsaName(isa) << " tile=" << tile);
      CpuUpdater updater({.threads = 2, .tile_elems = tile, .isa = isa});
      EXPECT_EQ(updater.isa(), isa);
      EXPECT_EQ(updater.threads(), 2);
      EXPECT_EQ(updater.tile_elems() % 32, 0u);
      Workload parallel = MakeWorkload(1), serial = MakeWorkload(1);
      for (int step = 0; step < 2; ++step) {
        updater.Run(parallel.items);
        RunSerially(serial, isa);
      }
      ExpectSameState(parallel, serial);
    }
  }
}

// Streaming stores and pinned threads change where results go and which core
// computes them, never the bits.
TEST(CpuUpdaterTest, StoresAndPinningKeepResultsBitIdentical) {
  for (Stores stores : {Stores::kCached, Stores::kStreamOut, Stores::kStreamAll}) {
    for (bool pin : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "stores=" << static_cast<int>(stores) << " pin=" << pin);
      CpuUpdater updater({.threads = 3, .tile_elems = 4096, .stores = stores, .pin_threads = pin});
      EXPECT_EQ(updater.stores(), stores);
      Workload parallel = MakeWorkload(3), serial = MakeWorkload(3);
      for (int step = 0; step < 2; ++step) {
        updater.Run(parallel.items);
        RunSerially(serial, updater.isa());
      }
      ExpectSameState(parallel, serial);
    }
  }
}

// Compact state through the tiles: each tile hashes its own element_offset,
// so the tiled run equals one serial call over the whole run, bit for bit.
TEST(CpuUpdaterTest, CompactStateTiledEqualsSerial) {
  constexpr size_t kN = 300001;
  AdamBuffers a(kN, DType::kBF16, DType::kBF16, 1, 9);
  AdamBuffers b = a;
  std::vector<uint16_t> am(kN + 1), av(kN + 1);
  for (size_t i = 0; i < kN + 1; ++i) {
    am[i] = FloatToBF16(a.exp_avg[i]);
    av[i] = FloatToBF16(a.exp_avg_sq[i]);
  }
  std::vector<uint16_t> bm = am, bv = av;
  auto compact = [](AdamBuffers& buf, std::vector<uint16_t>& m, std::vector<uint16_t>& v) {
    AdamSpan s = buf.Span();
    s.exp_avg = s.exp_avg_sq = nullptr;
    s.exp_avg_bf16 = m.data() + 1;
    s.exp_avg_sq_bf16 = v.data() + 1;
    s.element_offset = 77;
    return s;
  };
  for (Stores stores : {Stores::kCached, Stores::kStreamOut, Stores::kStreamAll}) {
    CpuUpdater updater({.threads = 3, .tile_elems = 4096, .stores = stores});
    const AdamScalars s = MakeAdamScalars({1e-3, 0.9, 0.999, 1e-8, 0.01}, true,
                                          2 + static_cast<int>(stores), 1.0, 1.0);
    const CpuUpdater::Item item{s, compact(a, am, av)};
    updater.Run({&item, 1});
    AdamKernel(updater.isa())(s, compact(b, bm, bv));
    ASSERT_EQ(std::memcmp(a.master.data(), b.master.data(), a.master.size() * 4), 0);
    ASSERT_EQ(am, bm);
    ASSERT_EQ(av, bv);
    ASSERT_EQ(a.out, b.out);
  }
}

// The delayed update's workers run niced (CpuUpdaterOptions::worker_nice):
// the same bits, and the calling thread (a session's step thread) keeps its
// own nice value.
TEST(CpuUpdaterTest, NicedWorkersKeepResultsAndTheCallersNice) {
  errno = 0;
  const int before = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  ASSERT_EQ(errno, 0);
  CpuUpdater updater({.threads = 3, .tile_elems = 4096, .worker_nice = 19});
  Workload parallel = MakeWorkload(3), serial = MakeWorkload(3);
  for (int step = 0; step < 2; ++step) {
    updater.Run(parallel.items);
    RunSerially(serial, updater.isa());
  }
  ExpectSameState(parallel, serial);
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))), before);
}

TEST(CpuUpdaterTest, PinningLeavesTheCallersAffinityAlone) {
  cpu_set_t before, after;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof before, &before), 0);
  CpuUpdater updater({.threads = 2, .tile_elems = 1024, .pin_threads = true});
  Workload w = MakeWorkload(5);
  updater.Run(w.items);
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof after, &after), 0);
  EXPECT_TRUE(CPU_EQUAL(&before, &after));
}

TEST(CpuUpdaterTest, ConcurrentCallersShareTheArena) {
  CpuUpdater updater({.threads = 2, .tile_elems = 2048});
  constexpr int kCallers = 4;
  std::vector<Workload> parallel, serial;
  for (int c = 0; c < kCallers; ++c) {
    parallel.push_back(MakeWorkload(100 + c));
    serial.push_back(MakeWorkload(100 + c));
  }
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int step = 0; step < 3; ++step) updater.Run(parallel[c].items);
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    for (int step = 0; step < 3; ++step) RunSerially(serial[c], updater.isa());
    ExpectSameState(parallel[c], serial[c]);
  }
}

TEST(CpuUpdaterTest, AllFiniteOverManyRuns) {
  CpuUpdater updater({.threads = 2, .tile_elems = 1024});
  std::vector<float> a(100000, 1.0f);
  std::vector<uint16_t> b(5001, FloatToBF16(2.0f)), c(3, FloatToF16(-1.0f));
  std::vector<CpuUpdater::GradRun> runs = {{a.data(), DType::kF32, a.size()},
                                           {nullptr, DType::kF32, 0},
                                           {b.data(), DType::kBF16, b.size()},
                                           {c.data(), DType::kF16, c.size()}};
  EXPECT_TRUE(updater.AllFinite(runs));
  EXPECT_TRUE(updater.AllFinite({}));
  c[2] = 0x7c00;  // +inf
  EXPECT_FALSE(updater.AllFinite(runs));
  c[2] = 0;
  a[77777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(updater.AllFinite(runs));
  a[77777] = 0;
  b[5000] = 0xff80;
  EXPECT_FALSE(updater.AllFinite(runs));
}

TEST(CpuUpdaterTest, FirstTouchZeroesState) {
  CpuUpdater updater({.threads = 2, .tile_elems = 4096});
  Workload w = MakeWorkload(3);
  updater.FirstTouch(w.items);
  for (const auto& b : w.buffers) {
    for (size_t i = 0; i < b->n; ++i) {
      ASSERT_EQ(b->master[i + b->offset], 0.0f);
      ASSERT_EQ(b->exp_avg[i + b->offset], 0.0f);
      ASSERT_EQ(b->exp_avg_sq[i + b->offset], 0.0f);
    }
    if (b->offset > 0) {
      ASSERT_NE(b->master[b->offset - 1], 0.0f);  // nothing outside the span
    }
  }
}

TEST(CpuUpdaterTest, ZeroThreadsMeansAllCores) {
  CpuUpdater updater({.threads = 0});
  EXPECT_GE(updater.threads(), 1);
  updater.Run({});
}

}  // namespace
}  // namespace dos::cpu
