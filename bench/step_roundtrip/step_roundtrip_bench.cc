// Empty-step round trip through the real daemon: a trainer process steps a
// one-element shard through dosd's control block (no gRPC on the step path)
// and times dos_step() end to end. Starts its own dosd on a private socket.
//
//   dos_bench_step_roundtrip [--dosd PATH] [--steps N] [--machine NAME] [--out FILE]
//
// Prints median / p90 / p99 in microseconds beside a pipe round trip between
// two processes measured in the same run (the cheapest kernel-mediated
// hand-off), and writes JSON in the bench/results format.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dos/dos.h"

namespace {

using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

std::vector<double> PipeRoundTrips(int n) {
  int a[2], b[2];
  if (pipe(a) != 0 || pipe(b) != 0) return {};
  pid_t child = fork();
  if (child == 0) {
    close(a[1]);
    close(b[0]);
    char c;
    while (read(a[0], &c, 1) == 1) {
      if (write(b[1], &c, 1) != 1) break;
    }
    _exit(0);
  }
  close(a[0]);
  close(b[1]);
  std::vector<double> us;
  char c = 'x';
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) break;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  close(a[1]);
  close(b[0]);
  waitpid(child, nullptr, 0);
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dosd = DOS_DOSD_PATH, machine = "local", out;
  int steps = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--dosd") dosd = argv[i + 1];
    else if (k == "--steps") steps = std::atoi(argv[i + 1]);
    else if (k == "--machine") machine = argv[i + 1];
    else if (k == "--out") out = argv[i + 1];
  }
  // Before any gRPC use: gRPC's fork handlers make a later fork() unsafe.
  std::vector<double> pipe_us = PipeRoundTrips(steps);
  char dir_tmpl[] = "/tmp/dos-bench-XXXXXX";
  std::string dir = mkdtemp(dir_tmpl);
  std::string sock = dir + "/dosd.sock";
  pid_t daemon = fork();
  if (daemon == 0) {
    std::string flag = "--socket=" + sock;
    execl(dosd.c_str(), dosd.c_str(), flag.c_str(), "--log_level=warning", nullptr);
    _exit(127);
  }
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = sock.c_str();
  o.client_name = "step_roundtrip_bench";
  dos_session* s = nullptr;
  auto deadline = Clock::now() + std::chrono::seconds(20);
  while (dos_attach(&o, &s) != DOS_OK) {
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "cannot attach to %s: %s\n", sock.c_str(), dos_last_error());
      kill(daemon, SIGKILL);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  void *p = nullptr, *g = nullptr;
  dos_buffer_alloc(s, 64, &p);
  dos_buffer_alloc(s, 64, &g);
  static_cast<float*>(g)[0] = 0.5f;
  dos_tensor t{"one", DOS_DTYPE_F32, p, DOS_DTYPE_F32, g, 1, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  if (dos_register(s, &t, 1, &h, 1, nullptr) != DOS_OK) {
    std::fprintf(stderr, "register: %s\n", dos_last_error());
    return 1;
  }
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  a.gradients_checked = 1;
  dos_step_result r;
  std::vector<double> us;
  for (int i = 0; i < steps + 1000; ++i) {
    auto t0 = Clock::now();
    if (dos_step(s, &a, &r) != DOS_OK) {
      std::fprintf(stderr, "step: %s\n", dos_last_error());
      return 1;
    }
    if (i >= 1000) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  dos_detach(s);
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);

  double med = Percentile(us, 0.5), p90 = Percentile(us, 0.9), p99 = Percentile(us, 0.99);
  double pmed = Percentile(pipe_us, 0.5);
  std::printf("empty step through dosd (1-element shard, %d steps after 1000 warm-up)\n", steps);
  std::printf("  median %.2f us   p90 %.2f us   p99 %.2f us\n", med, p90, p99);
  std::printf("  pipe round trip between two processes, same run: median %.2f us\n", pmed);
  std::printf("  daemon-side update time reported for the last step: %.2f us\n", r.update_us);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) return 1;
    time_t now = time(nullptr);
    char date[16];
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
    std::fprintf(f,
                 "{\"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", \"results\": [\n"
                 "  {\"name\": \"empty_step_dosd_us_median\", \"value\": %.3f, \"unit\": \"us\"},\n"
                 "  {\"name\": \"empty_step_dosd_us_p90\", \"value\": %.3f, \"unit\": \"us\"},\n"
                 "  {\"name\": \"empty_step_dosd_us_p99\", \"value\": %.3f, \"unit\": \"us\"},\n"
                 "  {\"name\": \"pipe_roundtrip_us_median\", \"value\": %.3f, \"unit\": \"us\"}\n]}\n",
                 machine.c_str(), date, DOS_GIT_COMMIT, med, p90, p99, pmed);
    std::fclose(f);
  }
  return 0;
}
