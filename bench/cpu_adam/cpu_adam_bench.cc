// dos_bench_cpu_adam: the CPU Adam kernel (through CpuUpdater, as dosd runs
// it) on random data, judged against host memory bandwidth measured in the
// same run by STREAM-like yardsticks (stream_pass.h) that CpuUpdater runs
// over the kernel's own tiles, threads, partition and pinning, for every
// gradient x weight dtype and 1..N threads.
//
// Reported per thread count: Gparam/s and GB/s of each combination (bytes
// the kernel must move: gradient + 12 read, 12 + weight written), each
// yardstick's GB/s, host_bw_gbs (the best of the yardsticks with the
// kernel's 28-byte pattern, with ordinary or non-temporal stores: the most
// that pattern achieved on this machine in this run) and the percentage of
// it the kernel reached. Every pass of a thread count runs once per round,
// --repeats rounds after a warm-up, so that all see the same moments of a
// shared machine; figures are medians of their own runs.
// Results go to
// bench/results/cpu_adam_<machine>_<date>.json; torch_fused_cpu.py merges
// PyTorch's figure into the same file.
//
// Depends on libtbb and the C/C++ runtimes only (no abseil), so it runs on
// the GPU machine with the bundled libtbb alone.

#include <sys/mman.h>
#include <unistd.h>

#include <oneapi/tbb/info.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>
#include <vector>

#include "bench/cpu_adam/stream_pass.h"
#include "daemon/cpu/cpu_updater.h"

#ifndef DOS_SOURCE_DIR
#define DOS_SOURCE_DIR "."
#endif
#ifndef DOS_GIT_COMMIT
#define DOS_GIT_COMMIT "unknown"
#endif

namespace dos::bench {
namespace {

using cpu::CpuUpdater;

struct Flags {
  size_t params = size_t{256} << 20;
  bool quick = false;
  std::vector<int> threads;  // empty: 1, 2, 4, ..., N
  int repeats = 5;
  size_t tile_elems = 65536;
  std::string machine;
  std::string out;
  std::string commit = DOS_GIT_COMMIT;
  std::string isa;
  cpu::Stores stores = cpu::CpuUpdaterOptions{}.stores;  // dosd's default
  bool pin = false;
  bool thp = true;
  bool all_combos = true;
  bool compact = true;  // also the compact-state (bf16 m, v) main line
  size_t stagger = 0;  // bytes added to each successive array's start
};

void Usage() {
  std::fprintf(stderr,
               "usage: dos_bench_cpu_adam [--params=N] [--quick] [--threads=1,2,16] [--repeats=R]\n"
               "       [--tile=ELEMS] [--isa=scalar|avx2|avx512] [--machine=NAME] [--out=FILE]\n"
               "       [--commit=SHA] [--stores=cached|ntout|ntall] [--pin=0|1] [--thp=0|1]\n"
               "       [--combos=all|main] [--stagger=BYTES] [--compact=0|1]\n"
               "  --params   elements per array (default 256Mi; 16Mi with --quick)\n"
               "  --threads  thread counts (default 1, 2, 4, ... and all cores)\n"
               "  --stores   the kernel's stores (CpuUpdaterOptions::stores)\n"
               "  --pin      pin arena slots to cores (CpuUpdaterOptions::pin_threads)\n"
               "  --thp      madvise(MADV_HUGEPAGE) on every array (default 1)\n"
               "  --combos   main: bf16 gradient, bf16 weight only\n"
               "  --stagger  offset each array's start by k*BYTES (4 KiB aliasing)\n"
               "  --compact  also run bf16 m and v (compact state), bf16 grad and weight\n");
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  bool params_set = false, repeats_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string_view key = arg.substr(0, eq);
    const std::string value(eq == std::string_view::npos ? "" : arg.substr(eq + 1));
    if (key == "--quick") {
      f->quick = true;
    } else if (key == "--params") {
      f->params = std::strtoull(value.c_str(), nullptr, 10);
      params_set = true;
    } else if (key == "--repeats") {
      f->repeats = std::atoi(value.c_str());
      repeats_set = true;
    } else if (key == "--tile") {
      f->tile_elems = std::strtoull(value.c_str(), nullptr, 10);
    } else if (key == "--threads") {
      for (const char* p = value.c_str(); *p != '\0';) {
        char* end;
        f->threads.push_back(static_cast<int>(std::strtol(p, &end, 10)));
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p != '\0') return false;
      }
    } else if (key == "--machine") {
      f->machine = value;
    } else if (key == "--out") {
      f->out = value;
    } else if (key == "--commit") {
      f->commit = value;
    } else if (key == "--isa") {
      f->isa = value;
    } else if (key == "--stores") {
      if (value == "cached") {
        f->stores = cpu::Stores::kCached;
      } else if (value == "ntout") {
        f->stores = cpu::Stores::kStreamOut;
      } else if (value == "ntall") {
        f->stores = cpu::Stores::kStreamAll;
      } else {
        return false;
      }
    } else if (key == "--pin") {
      f->pin = value != "0";
    } else if (key == "--compact") {
      f->compact = value != "0";
    } else if (key == "--thp") {
      f->thp = value != "0";
    } else if (key == "--combos") {
      if (value != "all" && value != "main") return false;
      f->all_combos = value == "all";
    } else if (key == "--stagger") {
      f->stagger = std::strtoull(value.c_str(), nullptr, 10);
    } else {
      return false;
    }
  }
  if (f->quick) {
    if (!params_set) f->params = size_t{16} << 20;
    if (!repeats_set) f->repeats = 3;
  }
  return f->params > 0 && f->repeats > 0;
}

// Anonymous mappings aligned to 2 MiB, never initialised here: the first
// touch happens in the updater's arena (FirstTouch and the parallel fill), as
// in dosd. With thp, madvise(MADV_HUGEPAGE) asks for 2 MiB pages (fewer TLB
// misses over 5-8 streams per thread); the start is offset by `skew` bytes.
template <typename T>
struct Buffer {
  Buffer() = default;
  void Allocate(size_t n, bool thp, size_t skew) {
    constexpr size_t kHuge = size_t{2} << 20;
    bytes = (n * sizeof(T) + skew + 2 * kHuge - 1) / kHuge * kHuge + kHuge;
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      std::fprintf(stderr, "dos_bench_cpu_adam: mmap of %zu bytes: %s\n", bytes,
                   std::strerror(errno));
      std::exit(1);
    }
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge;
    if (thp) madvise(reinterpret_cast<void*>(aligned), bytes - kHuge, MADV_HUGEPAGE);
    data = reinterpret_cast<T*>(aligned + skew);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (base != nullptr) munmap(base, bytes);
  }
  void* base = nullptr;
  size_t bytes = 0;
  T* data = nullptr;
};

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1).
float Uniform(uint64_t* s) {
  return static_cast<float>(static_cast<int64_t>(SplitMix(s) >> 11) - (int64_t{1} << 52)) *
         0x1p-52f;
}

struct Data {
  Data(size_t n, bool all, bool compact, bool thp, size_t stagger) : n(n) {
    size_t k = 0;
    p.Allocate(n, thp, stagger * k++);
    m.Allocate(n, thp, stagger * k++);
    v.Allocate(n, thp, stagger * k++);
    gbf.Allocate(n, thp, stagger * k++);
    obf.Allocate(n, thp, stagger * k++);
    if (compact) {
      m16.Allocate(n, thp, stagger * k++);
      v16.Allocate(n, thp, stagger * k++);
    }
    if (all) {
      g32.Allocate(n, thp, stagger * k++);
      g16.Allocate(n, thp, stagger * k++);
      o32.Allocate(n, thp, stagger * k++);
      o16.Allocate(n, thp, stagger * k++);
    }
  }
  size_t n;
  Buffer<float> p, m, v, g32;
  Buffer<uint16_t> g16, gbf;
  Buffer<float> o32;
  Buffer<uint16_t> o16, obf;
  Buffer<uint16_t> m16, v16;  // compact state

  const void* Grad(DType d) const {
    return d == DType::kF32 ? static_cast<const void*>(g32.data)
                            : d == DType::kBF16 ? static_cast<const void*>(gbf.data) : g16.data;
  }
  void* Out(DType d) {
    return d == DType::kF32 ? static_cast<void*>(o32.data)
                            : d == DType::kBF16 ? static_cast<void*>(obf.data) : o16.data;
  }
};

// Fills every array of `d` through the updater's own tiles (so each page is
// first touched by the thread that later works on it), seeded per element
// index so that the data do not depend on the thread count.
Data* g_fill = nullptr;
void FillTile(const cpu::AdamScalars&, const cpu::AdamSpan& s) {
  Data* d = g_fill;
  const size_t begin = static_cast<size_t>(s.master - d->p.data);
  for (size_t i = begin; i < begin + s.n; ++i) {
    uint64_t seed = i * 0x9e3779b97f4a7c15ull;
    const float g = Uniform(&seed) * 1e-2f;
    d->p.data[i] = Uniform(&seed);
    d->m.data[i] = 0.1f * g;
    d->v.data[i] = 1e-5f + 1e-3f * g * g;
    d->gbf.data[i] = FloatToBF16(g);
    d->obf.data[i] = 0;
    if (d->m16.data != nullptr) {
      d->m16.data[i] = FloatToBF16(d->m.data[i]);
      d->v16.data[i] = FloatToBF16(d->v.data[i]);
    }
    if (d->g32.data != nullptr) {
      d->g32.data[i] = g;
      d->g16.data[i] = FloatToF16(g);
      d->o32.data[i] = 0.0f;
      d->o16.data[i] = 0;
    }
  }
}

void Fill(CpuUpdater& updater, Data* d) {
  g_fill = d;
  const CpuUpdater::Item all{{}, {d->gbf.data, DType::kBF16, d->p.data, d->m.data, d->v.data,
                                  d->obf.data, DType::kBF16, d->n}};
  updater.RunKernel(FillTile, {&all, 1});
  g_fill = nullptr;
}

// The process's AnonHugePages line (how much of the state THP backs).
std::string HugePagesLine() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return "AnonHugePages: unknown";
  char line[256];
  std::string out = "AnonHugePages: unknown";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "AnonHugePages:", 14) == 0) {
      out = line;
      while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
      for (size_t p = out.find("  "); p != std::string::npos; p = out.find("  ")) out.erase(p, 1);
    }
  }
  std::fclose(f);
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double Seconds(const Fn& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string_view Short(DType d) {
  return d == DType::kF32 ? "fp32" : d == DType::kBF16 ? "bf16" : "fp16";
}

struct Result {
  std::string name;
  double value;
  const char* unit;
};

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

bool WriteJson(const std::string& path, const Flags& f, const std::string& date,
               const std::vector<Result>& results) {
  std::FILE* out = std::fopen(path.c_str(), "w");
  if (out == nullptr) return false;
  std::fprintf(out, "{\n  \"machine\": \"%s\",\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n",
               f.machine.c_str(), date.c_str(), f.commit.c_str());
  std::fprintf(out, "  \"params\": %zu,\n  \"results\": [\n", f.params);
  for (size_t i = 0; i < results.size(); ++i) {
    std::fprintf(out, "    {\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"}%s\n",
                 results[i].name.c_str(), results[i].value, results[i].unit,
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(out, "  ]\n}\n");
  return std::fclose(out) == 0;
}

int Main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) {
    Usage();
    return 2;
  }
  if (f.machine.empty()) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    f.machine = host;
  }
  cpu::Isa isa = cpu::BestIsa();
  if (!f.isa.empty() && !cpu::ParseIsa(f.isa, &isa)) {
    Usage();
    return 2;
  }
  const int cores = tbb::info::default_concurrency();
  if (f.threads.empty()) {
    for (int t = 1; t < cores; t *= 2) f.threads.push_back(t);
    f.threads.push_back(cores);
  }
  const int max_threads = *std::max_element(f.threads.begin(), f.threads.end());
  const std::string date = Today();
  if (f.out.empty()) {
    f.out = std::string(DOS_SOURCE_DIR) + "/bench/results/cpu_adam_" + f.machine + "_" + date +
            ".json";
  }
  const char* stores_name = f.stores == cpu::Stores::kCached      ? "cached"
                            : f.stores == cpu::Stores::kStreamOut ? "ntout"
                                                                  : "ntall";
  std::printf("dos_bench_cpu_adam: machine=%s cores=%d isa=%s params=%zu (%.2f GiB of state) "
              "repeats=%d tile=%zu stores=%s pin=%d thp=%d stagger=%zu commit=%s\n",
              f.machine.c_str(), cores, std::string(cpu::IsaName(isa)).c_str(), f.params,
              f.params * 12.0 / (1 << 30), f.repeats, f.tile_elems, stores_name, f.pin, f.thp,
              f.stagger, f.commit.c_str());
  auto options = [&](int t) {
    return cpu::CpuUpdaterOptions{.threads = t, .tile_elems = f.tile_elems, .isa = isa,
                                  .stores = f.stores, .pin_threads = f.pin};
  };

  Data d(f.params, f.all_combos, f.compact, f.thp, f.stagger);
  {
    CpuUpdater toucher(options(max_threads));
    const CpuUpdater::Item all{{}, {d.gbf.data, DType::kBF16, d.p.data, d.m.data, d.v.data,
                                    nullptr, DType::kBF16, f.params}};
    const auto t0 = std::chrono::steady_clock::now();
    toucher.FirstTouch({&all, 1});
    Fill(toucher, &d);
    std::printf("first touch and fill: %.2f s; %s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                HugePagesLine().c_str());
  }

  const GroupStepParams group{1e-3, 0.9, 0.999, 1e-8, 0.01};
  struct Combo {
    DType grad, out;
    bool compact;
  };
  std::vector<Combo> combos;
  if (f.all_combos) {
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType o : {DType::kBF16, DType::kF16, DType::kF32}) combos.push_back({g, o, false});
    }
  } else {
    combos.push_back({DType::kBF16, DType::kBF16, false});
  }
  if (f.compact) combos.push_back({DType::kBF16, DType::kBF16, true});
  const std::vector<Yardstick> yardsticks = Yardsticks();
  std::vector<Result> results;
  int64_t step = 0;
  for (int t : f.threads) {
    CpuUpdater updater(options(t));
    const std::string ts = "_t" + std::to_string(t);
    const CpuUpdater::Item pass_item{{}, {d.gbf.data, DType::kBF16, d.p.data, d.m.data, d.v.data,
                                          d.obf.data, DType::kBF16, f.params}};
    // Warm-up: arena threads, page tables.
    for (const Yardstick& y : yardsticks) updater.RunKernel(y.fn, {&pass_item, 1});
    auto kernel = [&](const Combo& c) {
      CpuUpdater::Item item{
          cpu::MakeAdamScalars(group, true, ++step, 1.0, 1.0),
          {d.Grad(c.grad), c.grad, d.p.data, d.m.data, d.v.data, d.Out(c.out), c.out, f.params}};
      if (c.compact) {
        item.span.exp_avg = item.span.exp_avg_sq = nullptr;
        item.span.exp_avg_bf16 = d.m16.data;
        item.span.exp_avg_sq_bf16 = d.v16.data;
      }
      updater.Run({&item, 1});
    };
    for (const Combo& c : combos) kernel(c);
    std::vector<std::vector<double>> yard_s(yardsticks.size()), kernel_s(combos.size());
    for (int r = 0; r < f.repeats; ++r) {
      for (size_t y = 0; y < yardsticks.size(); ++y) {
        yard_s[y].push_back(Seconds([&] { updater.RunKernel(yardsticks[y].fn, {&pass_item, 1}); }));
      }
      for (size_t c = 0; c < combos.size(); ++c) {
        kernel_s[c].push_back(Seconds([&] { kernel(combos[c]); }));
      }
    }
    double host_gbs = 0;
    std::string host_from;
    std::printf("\nthreads=%d yardsticks:", t);
    for (size_t y = 0; y < yardsticks.size(); ++y) {
      const double gbs = f.params * double(yardsticks[y].bytes_per_element) / Median(yard_s[y]) / 1e9;
      std::printf(" %s=%.1f", std::string(yardsticks[y].name).c_str(), gbs);
      results.push_back({"host_" + std::string(yardsticks[y].name) + "_gbs" + ts, gbs, "GB/s"});
      if (t == max_threads) {
        results.push_back({"host_" + std::string(yardsticks[y].name) + "_gbs", gbs, "GB/s"});
      }
      if (yardsticks[y].name.starts_with("adam") && gbs > host_gbs) {
        host_gbs = gbs;
        host_from = yardsticks[y].name;
      }
    }
    std::printf(" GB/s; host_bw_gbs=%.1f (%s)\n", host_gbs, host_from.c_str());
    std::printf("%7s %5s %5s %5s %10s %9s %12s %10s\n", "threads", "state", "grad", "out",
                "Gparam/s", "GB/s", "host GB/s", "% of host");
    for (size_t c = 0; c < combos.size(); ++c) {
      const auto [g, o, compact] = combos[c];
      const double gparams = f.params / Median(kernel_s[c]) / 1e9;
      const double gbs = gparams * cpu::AdamBytesPerElement(g, o, compact);
      const double pct = 100.0 * gbs / host_gbs;
      std::printf("%7d %5s %5s %5s %10.3f %9.1f %12.1f %9.1f%%\n", t, compact ? "bf16" : "fp32",
                  Short(g).data(), Short(o).data(), gparams, gbs, host_gbs, pct);
      const std::string combo = std::string(compact ? "bf16state_" : "fp32state_") +
                                std::string(Short(g)) + "grad_" + std::string(Short(o)) + "out";
      results.push_back({"cpu_adam_gparams_" + combo + ts, gparams, "Gparam/s"});
      results.push_back({"cpu_adam_gbs_" + combo + ts, gbs, "GB/s"});
      results.push_back({"cpu_adam_pct_host_bw_" + combo + ts, pct, "%"});
      if (t == max_threads) {
        results.push_back({"cpu_adam_gparams_" + combo, gparams, "Gparam/s"});
        results.push_back({"cpu_adam_pct_host_bw_" + combo, pct, "%"});
      }
    }
    results.push_back({"host_bw_gbs" + ts, host_gbs, "GB/s"});
    if (t == max_threads) results.push_back({"host_bw_gbs", host_gbs, "GB/s"});
    std::fflush(stdout);
  }
  results.push_back({"cpu_adam_threads", static_cast<double>(max_threads), "threads"});
  results.push_back({"cpu_adam_params", static_cast<double>(f.params), "params"});
  results.push_back({"cpu_adam_tile_elems", static_cast<double>(f.tile_elems), "elements"});
  results.push_back({"cpu_adam_pin_threads", f.pin ? 1.0 : 0.0, "bool"});
  results.push_back({"cpu_adam_thp", f.thp ? 1.0 : 0.0, "bool"});
  results.push_back({"cpu_adam_stores_" + std::string(stores_name), 1.0, "bool"});
  if (!WriteJson(f.out, f, date, results)) {
    std::fprintf(stderr, "dos_bench_cpu_adam: cannot write %s: %s\n", f.out.c_str(),
                 std::strerror(errno));
    return 1;
  }
  std::printf("\nwrote %s\n", f.out.c_str());
  return 0;
}

}  // namespace
}  // namespace dos::bench

int main(int argc, char** argv) { return dos::bench::Main(argc, argv); }
