// A deterministic trainer for the crash-survival fault tests: its weights,
// gradients and learning rates are pure functions of (step, tensor, index),
// so an interrupted run and an uninterrupted one must end bit for bit equal.
//
//   crash_trainer SOCKET OUT TOTAL_STEPS KILL_AT [SESSION_ID TOKEN]
//
// Attaches as client "crash_trainer" rank 0 (or resumes SESSION_ID with
// TOKEN), registers three tensors of awkward sizes and mixed dtypes across
// two groups, reads the daemon's step count (non-zero after a resume or a
// restore from a checkpoint), and steps until TOTAL_STEPS. At step KILL_AT
// (0: never) it publishes the step and SIGKILLs itself without waiting: the
// daemon completes that step or never starts it. A fresh attach writes
// "<id> <token>" to OUT.session first. At the end OUT gets, per tensor, the
// 16/32-bit weights, then the daemon's fp32 master, exp_avg, exp_avg_sq and
// the step count. Exit codes: 0 done, 2 attach/resume refused (message on
// stderr), 3+ other failures.
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dos/dos.h"

namespace {

uint32_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// In [-1, 1), a function of its arguments only.
float Value(uint64_t step, uint64_t tensor, uint64_t i) {
  uint32_t h = Mix((step << 40) ^ (tensor << 32) ^ i);
  return static_cast<float>(h) / 2147483648.0f - 1.0f;
}

uint16_t ToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

struct Tensor {
  const char* name;
  dos_dtype dtype;
  uint64_t numel;
  uint32_t group;
  void* param = nullptr;
  void* grad = nullptr;
};

size_t Size(dos_dtype d) { return d == DOS_DTYPE_F32 ? 4 : 2; }

void Store(dos_dtype d, void* p, uint64_t i, float v) {
  if (d == DOS_DTYPE_F32) {
    static_cast<float*>(p)[i] = v;
  } else {
    // bf16 for both 16-bit types keeps this file short; an f16 gradient
    // with bf16 bits is still a deterministic, finite value.
    static_cast<uint16_t*>(p)[i] = d == DOS_DTYPE_BF16 ? ToBF16(v) : 0x3c00 ^ (Mix(i) & 0x3ff);
  }
}

int Fail(int code, const char* what) {
  std::fprintf(stderr, "crash_trainer: %s: %s\n", what, dos_last_error());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 7) return 64;
  const std::string out = argv[2];
  const int64_t total = std::atoll(argv[3]);
  const int64_t kill_at = std::atoll(argv[4]);
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = argv[1];
  o.client_name = "crash_trainer";
  o.rank = 0;
  dos_session* s = nullptr;
  if (argc == 7) {
    if (dos_resume(&o, std::strtoull(argv[5], nullptr, 10), argv[6], &s) != DOS_OK) {
      return Fail(2, "resume");
    }
  } else {
    if (dos_attach(&o, &s) != DOS_OK) return Fail(2, "attach");
    FILE* f = std::fopen((out + ".session").c_str(), "w");
    if (f == nullptr) return 3;
    std::fprintf(f, "%llu %s\n", static_cast<unsigned long long>(dos_session_id(s)),
                 dos_session_token(s));
    std::fclose(f);
  }
  std::vector<Tensor> tensors = {{"embed", DOS_DTYPE_BF16, 70001, 0},
                                 {"norm", DOS_DTYPE_F32, 1234, 1},
                                 {"proj", DOS_DTYPE_BF16, 33333, 0}};
  std::vector<dos_tensor> specs;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    Tensor& x = tensors[t];
    if (dos_buffer_alloc(s, x.numel * Size(x.dtype), &x.param) != DOS_OK ||
        dos_buffer_alloc(s, x.numel * Size(x.dtype), &x.grad) != DOS_OK) {
      return Fail(3, "buffer_alloc");
    }
    // A restarted process initialises its weights as a fresh one would; a
    // resume or restore must overwrite them from the daemon's masters.
    for (uint64_t i = 0; i < x.numel; ++i) Store(x.dtype, x.param, i, 0.5f * Value(0, t, i));
    specs.push_back({x.name, x.dtype, x.param, x.dtype, x.grad, x.numel, x.group});
  }
  dos_hparams groups[2];
  dos_hparams_init_adamw(&groups[0]);
  dos_hparams_init_adamw(&groups[1]);
  groups[1].weight_decay = 0;
  groups[1].decoupled_weight_decay = 0;
  dos_register_options ro{50000};  // subgroups span tensor boundaries
  if (dos_register(s, specs.data(), specs.size(), groups, 2, &ro) != DOS_OK) {
    return Fail(4, "register");
  }
  int64_t done = 0;
  if (dos_state_read(s, 0, nullptr, nullptr, nullptr, &done) != DOS_OK) {
    return Fail(5, "state_read");
  }
  std::fprintf(stderr, "crash_trainer: resumed=%d starting after step %lld\n",
               dos_session_resumed(s), static_cast<long long>(done));
  for (int64_t k = done + 1; k <= total; ++k) {
    for (uint32_t t = 0; t < tensors.size(); ++t) {
      for (uint64_t i = 0; i < tensors[t].numel; ++i) {
        Store(tensors[t].dtype, tensors[t].grad, i, Value(k, t + 7, i));
      }
    }
    dos_hparams h[2] = {groups[0], groups[1]};
    h[0].lr = 1e-3 * static_cast<double>(1 + k % 3);  // a schedule
    h[1].lr = 2e-3;
    dos_step_args a;
    dos_step_args_init(&a);
    a.groups = h;
    a.num_groups = 2;
    a.clip_coef = k % 2 == 0 ? 0.5 : 1.0;
    if (k == kill_at) {
      if (dos_step_begin(s, &a) != DOS_OK) return Fail(6, "step_begin");
      ::raise(SIGKILL);  // mid-step: the daemon may be reading our gradients now
    }
    dos_step_result r;
    if (dos_step(s, &a, &r) != DOS_OK) return Fail(7, "step");
  }
  FILE* f = std::fopen(out.c_str(), "wb");
  if (f == nullptr) return 8;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    const Tensor& x = tensors[t];
    std::fwrite(x.param, Size(x.dtype), x.numel, f);
    std::vector<float> master(x.numel), m(x.numel), v(x.numel);
    int64_t step = 0;
    if (dos_state_read(s, t, master.data(), m.data(), v.data(), &step) != DOS_OK) {
      return Fail(9, "state_read");
    }
    std::fwrite(master.data(), 4, x.numel, f);
    std::fwrite(m.data(), 4, x.numel, f);
    std::fwrite(v.data(), 4, x.numel, f);
    std::fwrite(&step, sizeof step, 1, f);
  }
  std::fclose(f);
  return dos_detach(s) == DOS_OK ? 0 : 10;
}
