// A GPU-mode trainer that dies with a step in flight: it registers 64M bf16
// parameters in cudaMalloc'd memory through libdos_client (CUDA IPC), begins
// a step and exits at once without waiting or detaching, so the daemon is
// still reading its gradients and writing its weights when the process (and
// its CUDA context, which owns that memory) goes away.
//   gpu_doomed_trainer SOCKET
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>

#include "dos/dos.h"

int main(int argc, char** argv) {
  if (argc != 2) return 64;
  const uint64_t n = uint64_t{64} << 20;
  void* w = nullptr;
  void* g = nullptr;
  if (cudaMalloc(&w, n * 2) != cudaSuccess || cudaMalloc(&g, n * 2) != cudaSuccess) return 2;
  cudaMemset(w, 0x3f, n * 2);
  cudaMemset(g, 0x3c, n * 2);
  cudaDeviceSynchronize();
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = argv[1];
  o.client_name = "gpu_doomed_trainer";
  dos_session* s = nullptr;
  if (dos_attach(&o, &s) != DOS_OK) return 3;
  dos_tensor t{"w", DOS_DTYPE_BF16, w, DOS_DTYPE_BF16, g, n, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  dos_register_options ro{.subgroup_size = 8 << 20};
  if (dos_register(s, &t, 1, &h, 1, &ro) != DOS_OK) {
    std::fprintf(stderr, "register: %s\n", dos_last_error());
    return 4;
  }
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  if (dos_step_begin(s, &a) != DOS_OK) return 5;
  _exit(0);  // the step is in flight
}
