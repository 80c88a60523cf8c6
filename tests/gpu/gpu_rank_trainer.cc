// One rank of a multi-GPU node for tests/gpu/multi_gpu_test.cc: on CUDA device
// DEVICE it registers bf16/fp16/fp32 tensors (cudaMalloc, CUDA IPC) with the
// node's one dosd, and the same tensors in shared memory (CPU mode, the
// reference) in a second session; says "registered" on stdout and waits for
// one byte on stdin (the test lists the sessions meanwhile, and releases all
// ranks at once so that their steps overlap); runs STEPS steps with the same
// gradients in both sessions (different per device); then checks that the GPU
// session reached the reference: 16-bit weights at most one unit in the last
// place apart, fp32 state within the tolerance of gpu_ipc_test.cc.
//   gpu_rank_trainer SOCKET DEVICE STEPS POLICY
// Exit 0: equal within tolerance; 2-6: a setup or step failed; 10: mismatch.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dos/wire/dtype.h"
#include "dos/dos.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using dos::testing::Bytes;
using dos::testing::FillValues;
using dos::testing::Layout;

const Layout kTensors[] = {{DOS_DTYPE_BF16, 300007}, {DOS_DTYPE_F32, 7777},
                           {DOS_DTYPE_F16, 50001}, {DOS_DTYPE_BF16, 1}};


int Fail(int code, const char* what, int device) {
  std::fprintf(stderr, "gpu_rank_trainer[cuda:%d]: %s: %s\n", device, what, dos_last_error());
  return code;
}

dos_session* Attach(const char* socket, const std::string& name, int rank) {
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = socket;
  o.client_name = name.c_str();
  o.rank = rank;
  o.local_rank = rank;
  o.world_size = 2;
  dos_session* s = nullptr;
  return dos_attach(&o, &s) == DOS_OK ? s : nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: gpu_rank_trainer SOCKET DEVICE STEPS POLICY\n");
    return 64;
  }
  const char* socket = argv[1];
  const int device = std::atoi(argv[2]);
  const int steps = std::atoi(argv[3]);
  const char* policy = argv[4];
  if (cudaSetDevice(device) != cudaSuccess) return Fail(2, "cudaSetDevice", device);
  const size_t n = std::size(kTensors);
  uint64_t total = 0;
  std::vector<uint64_t> offset;
  for (const Layout& l : kTensors) {
    offset.push_back(total);
    total += (Bytes(l) + 255) / 256 * 256;
  }
  const std::string name = "multi_gpu.rank" + std::to_string(device);
  dos_session* ref = Attach(socket, name + ".ref", device);
  dos_session* gpu = Attach(socket, name, device);
  if (ref == nullptr || gpu == nullptr) return Fail(3, "attach", device);
  void *rw = nullptr, *rg = nullptr;
  if (dos_buffer_alloc(ref, total, &rw) != DOS_OK || dos_buffer_alloc(ref, total, &rg) != DOS_OK) {
    return Fail(3, "dos_buffer_alloc", device);
  }
  char *dw = nullptr, *dg = nullptr;
  if (cudaMalloc(&dw, total) != cudaSuccess || cudaMalloc(&dg, total) != cudaSuccess ||
      cudaMemset(dg, 0, total) != cudaSuccess) {
    return Fail(2, "cudaMalloc", device);
  }
  std::vector<dos_tensor> rt, dt;
  for (size_t i = 0; i < n; ++i) {
    FillValues(kTensors[i], 1000 + 10 * device + i, 0.5f, static_cast<char*>(rw) + offset[i]);
    rt.push_back({"t", kTensors[i].dtype, static_cast<char*>(rw) + offset[i], kTensors[i].dtype,
                  static_cast<char*>(rg) + offset[i], kTensors[i].numel, 0});
    dt.push_back({"t", kTensors[i].dtype, dw + offset[i], kTensors[i].dtype, dg + offset[i],
                  kTensors[i].numel, 0});
  }
  if (cudaMemcpy(dw, rw, total, cudaMemcpyHostToDevice) != cudaSuccess) {
    return Fail(2, "cudaMemcpy", device);
  }
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  h.lr = 3e-3;
  h.weight_decay = 0.05;
  dos_register_options ro{.subgroup_size = 32768};
  if (dos_register(ref, rt.data(), n, &h, 1, &ro) != DOS_OK) return Fail(4, "register ref", device);
  if (dos_set_policy(ref, "cpu") != DOS_OK) return Fail(4, "policy ref", device);
  if (dos_register(gpu, dt.data(), n, &h, 1, &ro) != DOS_OK) return Fail(4, "register gpu", device);
  if (dos_set_policy(gpu, policy) != DOS_OK) return Fail(4, "policy gpu", device);

  std::printf("registered\n");
  std::fflush(stdout);
  char go = 0;
  if (::read(STDIN_FILENO, &go, 1) != 1) return Fail(5, "waiting for the go byte", device);

  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  for (int step = 1; step <= steps; ++step) {
    for (size_t i = 0; i < n; ++i) {
      FillValues(kTensors[i], step * 97 + 31 * device + i, 0.02f,
                 static_cast<char*>(rg) + offset[i]);
    }
    dos_step_result r;
    if (dos_step(ref, &a, &r) != DOS_OK) return Fail(6, "step ref", device);
    if (cudaMemcpy(dg, rg, total, cudaMemcpyHostToDevice) != cudaSuccess) {
      return Fail(2, "cudaMemcpy grads", device);
    }
    if (dos_step(gpu, &a, &r) != DOS_OK) return Fail(6, "step gpu", device);
    if (r.step != step) {
      std::fprintf(stderr, "cuda:%d: step %d answered as %lld\n", device, step,
                   static_cast<long long>(r.step));
      return 6;
    }
  }

  int bad_total = 0;
  std::vector<char> host(total);
  if (cudaMemcpy(host.data(), dw, total, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return Fail(2, "cudaMemcpy weights", device);
  }
  for (size_t i = 0; i < n; ++i) {
    const Layout& l = kTensors[i];
    const char* gw = host.data() + offset[i];
    const char* cw = static_cast<char*>(rw) + offset[i];
    size_t wdiff = 0;
    int worst_units = 0;
    for (uint64_t e = 0; e < l.numel; ++e) {
      if (l.dtype == DOS_DTYPE_F32) {
        wdiff += std::memcmp(gw + 4 * e, cw + 4 * e, 4) != 0;
      } else {
        int16_t x, y;
        std::memcpy(&x, gw + 2 * e, 2);
        std::memcpy(&y, cw + 2 * e, 2);
        wdiff += x != y;
        worst_units = std::max(worst_units, std::abs(int{x} - int{y}));
      }
    }
    if (worst_units > 1) {
      std::fprintf(stderr, "cuda:%d: tensor %zu: 16-bit weights %d units apart from CPU mode\n",
                   device, i, worst_units);
      ++bad_total;
    }
    if (wdiff > 0) {
      std::printf("cuda:%d: tensor %zu: %zu of %llu weights not bitwise equal to CPU mode\n",
                  device, i, wdiff, static_cast<unsigned long long>(l.numel));
    }
    // fp32 state: |a - b| <= 1e-5 |b| + 1e-5 max|b| per array (gpu_ipc_test.cc).
    const uint64_t m = l.numel;
    std::vector<float> as(3 * m), bs(3 * m);
    int64_t sa = 0, sb = 0;
    if (dos_state_read(gpu, i, as.data(), as.data() + m, as.data() + 2 * m, &sa) != DOS_OK ||
        dos_state_read(ref, i, bs.data(), bs.data() + m, bs.data() + 2 * m, &sb) != DOS_OK) {
      return Fail(6, "dos_state_read", device);
    }
    if (sa != steps || sb != steps) {
      std::fprintf(stderr, "cuda:%d: tensor %zu: step counts %lld / %lld, expected %d\n", device,
                   i, static_cast<long long>(sa), static_cast<long long>(sb), steps);
      ++bad_total;
    }
    size_t diff = 0;
    for (int w = 0; w < 3; ++w) {
      const float* av = as.data() + w * m;
      const float* bv = bs.data() + w * m;
      double scale = 0;
      for (uint64_t e = 0; e < m; ++e) scale = std::max(scale, std::abs(double(bv[e])));
      size_t bad = 0;
      for (uint64_t e = 0; e < m; ++e) {
        if (std::memcmp(av + e, bv + e, 4) == 0) continue;
        ++diff;
        const double d = std::abs(double(av[e]) - bv[e]);
        if (!(d <= 1e-5 * std::abs(double(bv[e])) + 1e-5 * scale)) ++bad;
      }
      if (bad > 0) {
        std::fprintf(stderr, "cuda:%d: tensor %zu state array %d: %zu of %llu values outside "
                     "the tolerance\n", device, i, w, bad, static_cast<unsigned long long>(m));
        ++bad_total;
      }
    }
    if (diff > 0) {
      std::printf("cuda:%d: tensor %zu: %zu of %llu fp32 state values not bitwise equal\n",
                  device, i, diff, static_cast<unsigned long long>(3 * m));
    }
  }
  dos_detach(gpu);
  dos_detach(ref);
  cudaFree(dw);
  cudaFree(dg);
  return bad_total == 0 ? 0 : 10;
}
