// Registration time of one shard through the real daemon: what a trainer
// waits for at `dos.torch.AdamW(...)` before its first step (dosd allocates
// and first-touches 12 bytes of fp32 state per parameter, reads the trainer's
// weights into the masters and, in GPU mode, page-locks the state).
//
//   dos_bench_register --params 6B [--device cpu|cuda] [--repeat 2]
//       [--tensor_numel 50M] [--label 6b] [--machine NAME] [--out FILE]
//       [--dosd PATH] [--dosd_arg --flag=value]...
//
// Starts its own dosd on a private socket (extra flags by --dosd_arg),
// registers a shard of `params` bf16 parameters (tensors of tensor_numel),
// `repeat` times, each in a fresh session; times dos_register() and, from a
// second thread reading dos_register_progress_read(), each phase. The first
// registration also pays for memory the host has never handed out before (on
// a VM whose memory grows as it is used that is most of it); later ones show
// the steady state. CPU mode puts the tensors in shared memory (the shard must
// fit in /dev/shm); CUDA mode in device memory (cudaMalloc).
//
// Writes JSON in the bench/results format: register_s_<label> (first),
// register_s_<label>_repeat (fastest later one), per phase
// register_<phase>_s_<label> and the phase's GB/s.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "dos/dos.h"
#ifdef DOS_BENCH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// "6B", "1.5B", "50M", "4096" -> elements.
uint64_t ParseCount(const std::string& s) {
  double v = std::atof(s.c_str());
  switch (s.empty() ? 0 : s.back()) {
    case 'K': case 'k': v *= 1e3; break;
    case 'M': case 'm': v *= 1e6; break;
    case 'B': case 'b': case 'G': case 'g': v *= 1e9; break;
    default: break;
  }
  return static_cast<uint64_t>(v);
}

struct PhaseTimes {
  std::map<std::string, double> seconds;   // by phase name
  std::map<std::string, uint64_t> bytes;
};

// Polls the session's registration progress until `done`; prints a line a
// second (what the trainer's log shows) and records each phase's duration.
void Watch(dos_session* s, const std::atomic<bool>* done, PhaseTimes* out) {
  std::string last_phase;
  dos_register_progress last{};
  auto next_print = Clock::now() + std::chrono::seconds(1);
  while (!done->load()) {
    dos_register_progress p{};
    if (dos_register_progress_read(s, &p) == DOS_OK) {
      const std::string name = p.phase_name != nullptr ? p.phase_name : "";
      if (name != last_phase && !last_phase.empty()) {
        out->seconds[last_phase] = last.phase_seconds;
        out->bytes[last_phase] = last.bytes_total;
      }
      if (!name.empty()) last = p;
      last_phase = name;
      if (!name.empty() && Clock::now() >= next_print) {
        const double rate = p.phase_seconds > 0 ? p.bytes_done / p.phase_seconds : 0;
        std::printf("  [%5.1f s] %-15s %7.2f of %7.2f GB  %6.2f GB/s  %5.1f s left\n",
                    p.total_seconds, name.c_str(), p.bytes_done * 1e-9, p.bytes_total * 1e-9,
                    rate * 1e-9,
                    rate > 0 ? (p.bytes_total - p.bytes_done) / rate : 0.0);
        std::fflush(stdout);
        next_print += std::chrono::seconds(1);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The last phase ended with the call; its final duration is at most one
  // poll interval longer than the last sample.
  if (!last_phase.empty()) {
    out->seconds[last_phase] = last.phase_seconds;
    out->bytes[last_phase] = last.bytes_total;
  }
}

struct Shard {
  std::vector<dos_tensor> tensors;
  std::vector<std::string> names;
  std::vector<void*> device_allocs;
};

bool MakeShard(dos_session* s, bool cuda, uint64_t params, uint64_t tensor_numel, Shard* out) {
  for (uint64_t done = 0, i = 0; done < params; done += tensor_numel, ++i) {
    const uint64_t n = std::min(tensor_numel, params - done);
    void *p = nullptr, *g = nullptr;
    if (cuda) {
#ifdef DOS_BENCH_WITH_CUDA
      if (cudaMalloc(&p, n * 2) != cudaSuccess || cudaMalloc(&g, n * 2) != cudaSuccess) {
        std::fprintf(stderr, "cudaMalloc of tensor %lu failed\n", static_cast<unsigned long>(i));
        return false;
      }
      cudaMemset(p, 0x3c, n * 2);  // bf16 0x3c3c ~ 0.0115
      cudaMemset(g, 0, n * 2);
      out->device_allocs.push_back(p);
      out->device_allocs.push_back(g);
#else
      std::fprintf(stderr, "built without CUDA; use --device cpu\n");
      return false;
#endif
    } else if (dos_buffer_alloc(s, n * 2, &p) != DOS_OK || dos_buffer_alloc(s, n * 2, &g) != DOS_OK) {
      std::fprintf(stderr, "buffer_alloc: %s\n", dos_last_error());
      return false;
    } else {
      std::memset(p, 0x3c, n * 2);
    }
    // Not "t" + std::to_string(i): GCC 12 at -O3 reports a false -Wrestrict
    // inside basic_string's operator+ (GCC bug 105329).
    out->names.push_back(std::to_string(i).insert(0, 1, 't'));
    out->tensors.push_back(dos_tensor{nullptr, DOS_DTYPE_BF16, p, DOS_DTYPE_BF16, g, n, 0});
  }
  for (size_t i = 0; i < out->tensors.size(); ++i) out->tensors[i].name = out->names[i].c_str();
#ifdef DOS_BENCH_WITH_CUDA
  if (cuda) cudaDeviceSynchronize();
#endif
  return true;
}

void FreeShard(Shard* shard) {
#ifdef DOS_BENCH_WITH_CUDA
  for (void* p : shard->device_allocs) cudaFree(p);
#endif
  shard->device_allocs.clear();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dosd = DOS_DOSD_PATH, machine = "local", out, label, device = "cpu";
  uint64_t params = 0, tensor_numel = 50'000'000;
  int repeat = 2;
  std::vector<std::string> dosd_args;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--dosd") dosd = argv[i + 1];
    else if (k == "--params") params = ParseCount(argv[i + 1]);
    else if (k == "--tensor_numel") tensor_numel = ParseCount(argv[i + 1]);
    else if (k == "--device") device = argv[i + 1];
    else if (k == "--repeat") repeat = std::atoi(argv[i + 1]);
    else if (k == "--label") label = argv[i + 1];
    else if (k == "--machine") machine = argv[i + 1];
    else if (k == "--out") out = argv[i + 1];
    else if (k == "--dosd_arg") dosd_args.push_back(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s (see the top of register_bench.cc)\n", k.c_str());
      return 2;
    }
  }
  if (params == 0 || tensor_numel == 0 || repeat < 1 || (device != "cpu" && device != "cuda")) {
    std::fprintf(stderr, "usage: %s --params N [--device cpu|cuda] [--repeat R] ...\n", argv[0]);
    return 2;
  }
  if (label.empty()) label = argv[std::find(argv, argv + argc, std::string("--params")) - argv + 1];
  for (char& c : label) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool cuda = device == "cuda";

  char dir_tmpl[] = "/tmp/dos-bench-XXXXXX";
  std::string dir = mkdtemp(dir_tmpl);
  std::string sock = dir + "/dosd.sock";
  pid_t daemon = fork();
  if (daemon == 0) {
    std::vector<std::string> args = {dosd, "--socket=" + sock, "--checkpoint_dir="};
    for (const std::string& a : dosd_args) args.push_back(a);
    std::vector<char*> av;
    for (std::string& a : args) av.push_back(a.data());
    av.push_back(nullptr);
    execv(dosd.c_str(), av.data());
    _exit(127);
  }
  std::printf("registering %.3g params (bf16 %s tensors of %.3g) = %.1f GB of fp32 state, "
              "%d time(s); dosd %s", static_cast<double>(params), device.c_str(),
              static_cast<double>(tensor_numel), params * 12e-9, repeat, dosd.c_str());
  for (const std::string& a : dosd_args) std::printf(" %s", a.c_str());
  std::printf("\n");

  std::vector<double> totals;
  PhaseTimes first_phases;
  int rc = 0;
  for (int r = 0; r < repeat && rc == 0; ++r) {
    dos_attach_options o;
    dos_attach_options_init(&o);
    o.socket_path = sock.c_str();
    o.client_name = "register_bench";
    dos_session* s = nullptr;
    auto deadline = Clock::now() + std::chrono::seconds(30);
    while (dos_attach(&o, &s) != DOS_OK) {
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "cannot attach to %s: %s\n", sock.c_str(), dos_last_error());
        kill(daemon, SIGKILL);
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Shard shard;
    if (!MakeShard(s, cuda, params, tensor_numel, &shard)) {
      rc = 1;
      dos_detach(s);
      break;
    }
    dos_hparams h;
    dos_hparams_init_adamw(&h);
    std::atomic<bool> done{false};
    PhaseTimes phases;
    std::thread watcher(Watch, s, &done, &phases);
    const auto t0 = Clock::now();
    const dos_status st =
        dos_register(s, shard.tensors.data(), shard.tensors.size(), &h, 1, nullptr);
    const double secs = Seconds(t0, Clock::now());
    done = true;
    watcher.join();
    if (st != DOS_OK) {
      std::fprintf(stderr, "register: %s\n", dos_last_error());
      rc = 1;
    } else {
      std::printf("registration %d: %.2f s", r + 1, secs);
      for (const auto& [name, s2] : phases.seconds) {
        std::printf("  %s %.2f s (%.1f GB/s)", name.c_str(), s2,
                    s2 > 0 ? phases.bytes[name] / s2 * 1e-9 : 0.0);
      }
      std::printf("\n");
      std::fflush(stdout);
      totals.push_back(secs);
      if (r == 0) first_phases = phases;
    }
    const auto d0 = Clock::now();
    dos_detach(s);
    FreeShard(&shard);
    std::printf("  detach (state freed): %.2f s\n", Seconds(d0, Clock::now()));
  }
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
  if (rc != 0 || totals.empty()) return 1;

  const double best_repeat =
      totals.size() > 1 ? *std::min_element(totals.begin() + 1, totals.end()) : totals[0];
  std::printf("register_s_%s %.2f (first)  %.2f (fastest repeat); judged against: 20 s target, "
              "75 s before this change, Megatron-Core optimizer setup 25 s (same 6B model)\n",
              label.c_str(), totals[0], best_repeat);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) return 1;
    time_t now = time(nullptr);
    char date[16];
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
    std::fprintf(f, "{\"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\",\n"
                    " \"params\": %lu, \"state_bytes\": %lu, \"device\": \"%s\", \"dosd_args\": [",
                 machine.c_str(), date, DOS_GIT_COMMIT, static_cast<unsigned long>(params),
                 static_cast<unsigned long>(params * 12), device.c_str());
    for (size_t i = 0; i < dosd_args.size(); ++i) {
      std::fprintf(f, "%s\"%s\"", i ? ", " : "", dosd_args[i].c_str());
    }
    std::fprintf(f, "],\n \"results\": [\n");
    std::fprintf(f, "  {\"name\": \"register_s_%s\", \"value\": %.3f, \"unit\": \"s\"},\n",
                 label.c_str(), totals[0]);
    std::fprintf(f, "  {\"name\": \"register_s_%s_repeat\", \"value\": %.3f, \"unit\": \"s\"}",
                 label.c_str(), best_repeat);
    for (const auto& [name, s2] : first_phases.seconds) {
      std::string key = name;
      std::replace(key.begin(), key.end(), ' ', '_');
      std::fprintf(f, ",\n  {\"name\": \"register_%s_s_%s\", \"value\": %.3f, \"unit\": \"s\"}",
                   key.c_str(), label.c_str(), s2);
      std::fprintf(f, ",\n  {\"name\": \"register_%s_gbps_%s\", \"value\": %.3f, \"unit\": \"GB/s\"}",
                   key.c_str(), label.c_str(), s2 > 0 ? first_phases.bytes[name] / s2 * 1e-9 : 0);
    }
    std::fprintf(f, "\n]}\n");
    std::fclose(f);
    std::printf("wrote %s\n", out.c_str());
  }
  return 0;
}
