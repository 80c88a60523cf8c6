// A trainer that attaches, registers, takes one step and exits without
// detaching: what a crashed training process looks like to the daemon.
// A separate program (not a fork of the test) because gRPC does not survive
// fork() in a process that already used it.
//   doomed_trainer SOCKET
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dos/dos.h"

int main(int argc, char** argv) {
  if (argc != 2) return 64;
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = argv[1];
  o.client_name = "doomed_trainer";
  dos_session* s = nullptr;
  if (dos_attach(&o, &s) != DOS_OK) return 2;
  const uint64_t n = 1 << 16;
  void* param = nullptr;
  void* grad = nullptr;
  if (dos_buffer_alloc(s, n * 2, &param) != DOS_OK || dos_buffer_alloc(s, n * 2, &grad) != DOS_OK) {
    return 3;
  }
  for (uint64_t i = 0; i < n; ++i) {
    static_cast<uint16_t*>(param)[i] = 0x3f80;  // bf16 1.0
    static_cast<uint16_t*>(grad)[i] = 0x3c00;   // bf16 ~0.0078
  }
  dos_tensor t{"w", DOS_DTYPE_BF16, param, DOS_DTYPE_BF16, grad, n, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  if (dos_register(s, &t, 1, &h, 1, nullptr) != DOS_OK) return 4;
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  dos_step_result r;
  if (dos_step(s, &a, &r) != DOS_OK) return 5;
  std::fflush(stdout);
  // No dos_detach: the daemon must notice that this process is gone. _Exit,
  // as a crash would, skips exit handlers (LeakSanitizer's among them: the
  // session is abandoned on purpose).
  std::_Exit(0);
}
