// bandwidth_probe: measures, on this machine and in this run, the inputs of
// the update-phase performance model (daemon/sched/perf_model.h) and prints
// them with the bound the model derives, as one JSON object:
//   pinned H2D, D2H, both directions at once; host memory (16-thread copy);
//   the CPU Adam kernel alone and while both DMA directions run (their sum
//   in bytes is the shared host-memory capacity M_host); the GPU kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "daemon/cpu/cpu_updater.h"
#include "daemon/gpu/adam_kernel.h"
#include "daemon/sched/perf_model.h"

namespace {
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(2); } } while (0)
double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

int main() {
  CK(cudaSetDevice(0));
  const size_t kBytes = size_t{1} << 30;
  char *h1, *h2, *d1, *d2;
  CK(cudaHostAlloc(&h1, kBytes, 0)); CK(cudaHostAlloc(&h2, kBytes, 0));
  CK(cudaMalloc(&d1, kBytes)); CK(cudaMalloc(&d2, kBytes));
  std::memset(h1, 1, kBytes); std::memset(h2, 2, kBytes);
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::vector<double> h2d, d2h, both;
  for (int i = 0; i < 5; ++i) {
    double t = Now(); CK(cudaMemcpyAsync(d1, h1, kBytes, cudaMemcpyHostToDevice, s1)); CK(cudaStreamSynchronize(s1)); h2d.push_back(kBytes / (Now() - t));
    t = Now(); CK(cudaMemcpyAsync(h2, d2, kBytes, cudaMemcpyDeviceToHost, s2)); CK(cudaStreamSynchronize(s2)); d2h.push_back(kBytes / (Now() - t));
    t = Now(); CK(cudaMemcpyAsync(d1, h1, kBytes, cudaMemcpyHostToDevice, s1)); CK(cudaMemcpyAsync(h2, d2, kBytes, cudaMemcpyDeviceToHost, s2));
    CK(cudaStreamSynchronize(s1)); CK(cudaStreamSynchronize(s2)); both.push_back(2.0 * kBytes / (Now() - t));
  }
  // Host memory: every core copies its share of 1 GiB (bytes read + written).
  const int threads = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<char> a(kBytes, 1), b(kBytes, 0);
  std::vector<double> host;
  for (int r = 0; r < 4; ++r) {
    double t = Now();
    std::vector<std::thread> ts;
    for (int i = 0; i < threads; ++i) ts.emplace_back([&, i] { size_t c = kBytes / threads; std::memcpy(b.data() + i * c, a.data() + i * c, c); });
    for (auto& th : ts) th.join();
    host.push_back(2.0 * kBytes / (Now() - t));
  }
  // CPU kernel: bf16 gradients in, bf16 weights out, fp32 state.
  const size_t n = 100'000'000;
  std::vector<float> state(3 * n, 0.01f);
  std::vector<uint16_t> grad(n, 0x3c00), wout(n);
  dos::cpu::CpuUpdater cpu({});
  dos::GroupStepParams gp{1e-3, 0.9, 0.999, 1e-8, 0.01};
  dos::cpu::AdamScalars sc = dos::cpu::MakeAdamScalars(gp, true, 1, 1.0, 1.0);
  dos::cpu::CpuUpdater::Item item{sc, {grad.data(), dos::DType::kBF16, state.data(), state.data() + n, state.data() + 2 * n, wout.data(), dos::DType::kBF16, n}};
  cpu.Run({&item, 1});
  std::vector<double> alone;
  for (int r = 0; r < 3; ++r) { double t = Now(); cpu.Run({&item, 1}); alone.push_back(n / (Now() - t)); }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> dma_bytes{0};
  std::thread dma([&] {
    CK(cudaSetDevice(0));
    while (!stop.load()) {
      CK(cudaMemcpyAsync(d1, h1, kBytes / 4, cudaMemcpyHostToDevice, s1));
      CK(cudaMemcpyAsync(h2, d2, kBytes / 4, cudaMemcpyDeviceToHost, s2));
      CK(cudaStreamSynchronize(s1)); CK(cudaStreamSynchronize(s2));
      dma_bytes += kBytes / 2;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the DMA loop reach steady state
  uint64_t b0 = dma_bytes.load();
  double t = Now();
  for (int r = 0; r < 3; ++r) cpu.Run({&item, 1});
  double dt = Now() - t;
  uint64_t b1 = dma_bytes.load();
  stop = true; dma.join();
  const double loaded = 3.0 * n / dt;
  const double dma_rate = static_cast<double>(b1 - b0) / dt;
  const double cpu_bytes_per_param = 24 + 2 + 2;
  const double m_host = loaded * cpu_bytes_per_param + dma_rate;
  // GPU kernel rate (state resident, bf16 gradients and weights).
  float* ds; uint16_t* dg; uint16_t* dw;
  CK(cudaMalloc(&ds, 12 * n)); CK(cudaMalloc(&dg, 2 * n)); CK(cudaMalloc(&dw, 2 * n));
  CK(cudaMemset(ds, 0, 12 * n)); CK(cudaMemset(dg, 0, 2 * n));
  dos::gpu::DeviceAdamSpan sp{dg, dos::DType::kBF16, ds, ds + n, ds + 2 * n, dw, dos::DType::kBF16, n};
  (void)dos::gpu::LaunchAdam(sc, sp, s1); CK(cudaStreamSynchronize(s1));
  t = Now();
  for (int r = 0; r < 10; ++r) (void)dos::gpu::LaunchAdam(sc, sp, s1);
  CK(cudaStreamSynchronize(s1));
  const double gpu_rate = 10.0 * n / (Now() - t);

  dos::PerfInputs in;
  in.cpu_params_per_s = median(alone);
  in.gpu_params_per_s = gpu_rate;
  in.h2d_bytes_per_s = median(h2d);
  in.d2h_bytes_per_s = median(d2h);
  in.pcie_both_bytes_per_s = median(both);
  in.host_bytes_per_s = m_host;
  dos::PerfPrediction p = dos::PerfModel::Solve(in);
  // The same machine with compact state (8 bytes a parameter; the CPU rate
  // scaled by the kernel's bytes, 28 -> 20).
  dos::PerfInputs in_compact = in;
  in_compact.state_bytes = 8;
  dos::PerfPrediction pc = dos::PerfModel::Solve(in_compact);
  std::printf("{\"h2d_gbps\":%.2f,\"d2h_gbps\":%.2f,\"both_gbps\":%.2f,\"host_copy_gbps\":%.2f,"
              "\"cpu_gparams_alone\":%.3f,\"cpu_gparams_under_dma\":%.3f,\"dma_gbps_under_cpu\":%.2f,"
              "\"m_host_gbps\":%.2f,\"gpu_kernel_gparams\":%.2f,\"bound_gparams\":%.3f,\"bound_x\":%.3f,"
              "\"bound_binding\":\"%s\",\"bound_gparams_compact\":%.3f,\"bound_x_compact\":%.3f,"
              "\"bound_binding_compact\":\"%s\",\"threads\":%d}\n",
              median(h2d) * 1e-9, median(d2h) * 1e-9, median(both) * 1e-9, median(host) * 1e-9,
              median(alone) * 1e-9, loaded * 1e-9, dma_rate * 1e-9, m_host * 1e-9, gpu_rate * 1e-9,
              p.params_per_s * 1e-9, p.gpu_share, p.binding.c_str(), pc.params_per_s * 1e-9,
              pc.gpu_share, pc.binding.c_str(), cpu.threads());
  return 0;
}
