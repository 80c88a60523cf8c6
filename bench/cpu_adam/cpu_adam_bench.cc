// dos_bench_cpu_adam: the CPU Adam kernel (through CpuUpdater, as dosd runs
// it) on random data, judged against host memory bandwidth measured in the
// same run by a STREAM-like pass with the kernel's access pattern
// (stream_pass.h), for every gradient x weight dtype and 1..N threads.
//
// Reported per thread count: Gparam/s and GB/s of each combination (bytes
// the kernel must move: gradient + 12 read, 12 + weight written), the
// stream pass's GB/s and the percentage of it reached. Kernel and stream
// pass alternate (--repeats times each, after a warm-up) so that both see the
// same moment of a shared machine; figures are medians of their own runs.
// Results go to
// bench/results/cpu_adam_<machine>_<date>.json; torch_fused_cpu.py merges
// PyTorch's figure into the same file.
//
// Depends on libtbb and the C/C++ runtimes only (no abseil), so it runs on
// the GPU machine with the bundled libtbb alone.

#include <unistd.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
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
};

void Usage() {
  std::fprintf(stderr,
               "usage: dos_bench_cpu_adam [--params=N] [--quick] [--threads=1,2,16] [--repeats=R]\n"
               "       [--tile=ELEMS] [--isa=scalar|avx2|avx512] [--machine=NAME] [--out=FILE]\n"
               "       [--commit=SHA]\n"
               "  --params   elements per array (default 256Mi; 16Mi with --quick)\n"
               "  --threads  thread counts (default 1, 2, 4, ... and all cores)\n");
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

// Page-aligned, never initialised here: the first touch happens in the
// arena (CpuUpdater::FirstTouch and the parallel fill), as in dosd.
template <typename T>
struct Buffer {
  explicit Buffer(size_t n)
      : data(static_cast<T*>(std::aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096))) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(data); }
  T* data;
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
  explicit Data(size_t n)
      : n(n), p(n), m(n), v(n), g32(n), g16(n), gbf(n), o32(n), o16(n), obf(n) {}
  size_t n;
  Buffer<float> p, m, v, g32;
  Buffer<uint16_t> g16, gbf;
  Buffer<float> o32;
  Buffer<uint16_t> o16, obf;

  const void* Grad(DType d) const {
    return d == DType::kF32 ? static_cast<const void*>(g32.data)
                            : d == DType::kBF16 ? static_cast<const void*>(gbf.data) : g16.data;
  }
  void* Out(DType d) {
    return d == DType::kF32 ? static_cast<void*>(o32.data)
                            : d == DType::kBF16 ? static_cast<void*>(obf.data) : o16.data;
  }
};

void Fill(tbb::task_arena& arena, Data* d, size_t tile) {
  const size_t tiles = (d->n + tile - 1) / tile;
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) {
            uint64_t s = t * 7919 + 1;
            for (size_t i = t * tile; i < std::min(d->n, (t + 1) * tile); ++i) {
              const float g = Uniform(&s) * 1e-2f;
              d->p.data[i] = Uniform(&s);
              d->m.data[i] = 0.1f * g;
              d->v.data[i] = 1e-5f + 1e-3f * g * g;
              d->g32.data[i] = g;
              d->gbf.data[i] = FloatToBF16(g);
              d->g16.data[i] = FloatToF16(g);
              d->o32.data[i] = 0.0f;
              d->o16.data[i] = 0;
              d->obf.data[i] = 0;
            }
          }
        },
        tbb::static_partitioner());
  });
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
  std::printf("dos_bench_cpu_adam: machine=%s cores=%d isa=%s params=%zu (%.2f GiB of state) "
              "repeats=%d tile=%zu commit=%s\n",
              f.machine.c_str(), cores, std::string(cpu::IsaName(isa)).c_str(), f.params,
              f.params * 12.0 / (1 << 30), f.repeats, f.tile_elems, f.commit.c_str());

  Data d(f.params);
  {
    CpuUpdater toucher({.threads = max_threads, .tile_elems = f.tile_elems, .isa = isa});
    const cpu::AdamScalars none{};
    const CpuUpdater::Item all{none, {d.g32.data, DType::kF32, d.p.data, d.m.data, d.v.data,
                                      nullptr, DType::kF32, f.params}};
    toucher.FirstTouch({&all, 1});
    tbb::task_arena arena(max_threads);
    Fill(arena, &d, f.tile_elems);
  }

  const GroupStepParams group{1e-3, 0.9, 0.999, 1e-8, 0.01};
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  std::vector<Result> results;
  std::printf("\n%7s %5s %5s %10s %9s %12s %10s\n", "threads", "grad", "out", "Gparam/s",
              "GB/s", "host GB/s", "% of host");
  int64_t step = 0;
  for (int t : f.threads) {
    CpuUpdater updater({.threads = t, .tile_elems = f.tile_elems, .isa = isa});
    tbb::task_arena arena(t);
    const std::string ts = "_t" + std::to_string(t);
    const StreamArrays sa{d.gbf.data, d.p.data, d.m.data, d.v.data, d.obf.data, f.params};
    auto stream = [&] { StreamPass(arena, sa, updater.tile_elems()); };
    stream();  // warm-up: arena threads, page tables
    std::vector<double> all_stream_s;
    for (DType g : dtypes) {
      for (DType o : {DType::kBF16, DType::kF16, DType::kF32}) {
        auto kernel = [&] {
          const CpuUpdater::Item item{
              cpu::MakeAdamScalars(group, true, ++step, 1.0, 1.0),
              {d.Grad(g), g, d.p.data, d.m.data, d.v.data, d.Out(o), o, f.params}};
          updater.Run({&item, 1});
        };
        kernel();  // warm-up
        // Kernel and yardstick alternate, so that both see the same state of
        // a shared machine; each figure is the median of its own runs.
        std::vector<double> kernel_s, stream_s;
        for (int r = 0; r < f.repeats; ++r) {
          stream_s.push_back(Seconds(stream));
          kernel_s.push_back(Seconds(kernel));
        }
        all_stream_s.insert(all_stream_s.end(), stream_s.begin(), stream_s.end());
        const double host_gbs = f.params * double{kStreamBytesPerElement} / Median(stream_s) / 1e9;
        const double gparams = f.params / Median(kernel_s) / 1e9;
        const double gbs = gparams * cpu::AdamBytesPerElement(g, o);
        const double pct = 100.0 * gbs / host_gbs;
        std::printf("%7d %5s %5s %10.3f %9.1f %12.1f %9.1f%%\n", t, Short(g).data(),
                    Short(o).data(), gparams, gbs, host_gbs, pct);
        const std::string combo = "fp32state_" + std::string(Short(g)) + "grad_" +
                                  std::string(Short(o)) + "out";
        results.push_back({"cpu_adam_gparams_" + combo + ts, gparams, "Gparam/s"});
        results.push_back({"cpu_adam_gbs_" + combo + ts, gbs, "GB/s"});
        results.push_back({"cpu_adam_pct_host_bw_" + combo + ts, pct, "%"});
        if (t == max_threads) {
          results.push_back({"cpu_adam_gparams_" + combo, gparams, "Gparam/s"});
          results.push_back({"cpu_adam_pct_host_bw_" + combo, pct, "%"});
        }
      }
    }
    const double host_gbs = f.params * double{kStreamBytesPerElement} / Median(all_stream_s) / 1e9;
    results.push_back({"host_bw_gbs" + ts, host_gbs, "GB/s"});
    if (t == max_threads) results.push_back({"host_bw_gbs", host_gbs, "GB/s"});
    std::fflush(stdout);
  }
  results.push_back({"cpu_adam_threads", static_cast<double>(max_threads), "threads"});
  results.push_back({"cpu_adam_params", static_cast<double>(f.params), "params"});
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
