// dos_bench_doorbell: what an empty optimizer step costs on the data plane.
//
// A forked child plays the daemon's step thread (WaitRequest -> PostResult,
// no work); the parent plays the client (PublishRequest -> WaitResult). Both
// share one control block in POSIX shared memory, exactly as dosd and the
// client library do. Measured:
//   empty_step_roundtrip   back-to-back steps: both sides are in their spin
//                          window, so no system call is made;
//   wake_from_sleep        steps after --idle_gap_us of idleness: the daemon
//                          sleeps in FUTEX_WAIT and the ring must wake it
//                          (the realistic case between training steps);
//   pipe_roundtrip         one byte each way over two pipes, measured in the
//                          same run as the reference an ordinary IPC costs.
// The limit (DESIGN.md section 2): the round trip costs microseconds.
// Results go to bench/results/doorbell_<machine>_<date>.json.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"

ABSL_FLAG(std::string, machine, "", "machine name for the results file (default: hostname)");
ABSL_FLAG(int, rounds, 100000, "measured back-to-back round trips");
ABSL_FLAG(int, warmup, 10000, "unmeasured round trips first");
ABSL_FLAG(int, idle_rounds, 1000, "measured round trips after an idle gap");
ABSL_FLAG(int, idle_gap_us, 1000, "idle time before each wake_from_sleep round trip");
ABSL_FLAG(std::string, out_dir, DOS_SOURCE_DIR "/bench/results", "where the JSON goes");

namespace dos {
namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double median, p90, p99, p999, max, mean;
};

Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) {
    return us[std::min(us.size() - 1, static_cast<size_t>(q * us.size()))];
  };
  double sum = 0;
  for (double v : us) sum += v;
  return {at(0.5), at(0.9), at(0.99), at(0.999), us.back(), sum / us.size()};
}

std::string Line(const Stats& s) {
  return absl::StrFormat("median %.2f us  p90 %.2f  p99 %.2f  p99.9 %.2f  max %.1f  mean %.2f",
                         s.median, s.p90, s.p99, s.p999, s.max, s.mean);
}

// The daemon's step thread with no step: answer every request at once until
// the client sets `closed` (which this bench uses as its stop signal) or
// goes away.
int RunDaemon(ControlBlock* block, pid_t client) {
  ControlBlockChannel channel(block);
  uint32_t last = 0;
  while (block->closed.load(std::memory_order_acquire) == 0) {
    const uint32_t seq = channel.WaitRequest(last, absl::Milliseconds(100));
    if (seq == last) {
      if (getppid() != client) return 1;
      continue;
    }
    channel.PostResult(seq);
    last = seq;
  }
  return 0;
}

// Round trips in microseconds; empty on a failed step.
std::vector<double> Measure(ControlBlockChannel& channel, int rounds, absl::Duration gap) {
  std::vector<double> us;
  us.reserve(rounds);
  for (int i = 0; i < rounds; ++i) {
    if (gap > absl::ZeroDuration()) absl::SleepFor(gap);
    const Clock::time_point t0 = Clock::now();
    const uint32_t seq = channel.PublishRequest();
    absl::Status s = channel.WaitResult(seq, absl::Seconds(10));
    const Clock::time_point t1 = Clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "step failed: %s\n", s.ToString().c_str());
      return {};
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return us;
}

std::vector<double> MeasurePipe(int rounds) {
  int to_child[2], to_parent[2];
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) return {};
  pid_t child = fork();
  if (child == 0) {
    // Close our copies of the parent's ends, or read() never sees EOF.
    close(to_child[1]);
    close(to_parent[0]);
    char c;
    while (read(to_child[0], &c, 1) == 1) {
      if (write(to_parent[1], &c, 1) != 1) _exit(1);
    }
    _exit(0);
  }
  std::vector<double> us;
  us.reserve(rounds);
  char c = 'x';
  for (int i = 0; i < rounds; ++i) {
    const Clock::time_point t0 = Clock::now();
    if (write(to_child[1], &c, 1) != 1 || read(to_parent[0], &c, 1) != 1) break;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  close(to_child[1]);  // the child's read() sees EOF and it exits
  waitpid(child, nullptr, 0);
  for (int fd : {to_child[0], to_parent[0], to_parent[1]}) close(fd);
  return us;
}

std::string Capture(const char* command) {
  std::string out;
  if (FILE* f = popen(command, "r")) {
    char buf[128];
    while (fgets(buf, sizeof(buf), f)) out += buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

// Keeps [A-Za-z0-9._-]; the machine name goes into a file name and JSON.
std::string Sanitize(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  }
  return s.empty() ? "unknown" : s;
}

int Main() {
  std::string machine = absl::GetFlag(FLAGS_machine);
  if (machine.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    machine = host;
  }
  machine = Sanitize(machine);
  const std::string date = absl::FormatTime("%Y-%m-%d", absl::Now(), absl::UTCTimeZone());
  std::string commit =
      Sanitize(Capture("git -C " DOS_SOURCE_DIR " rev-parse --short HEAD 2>/dev/null"));

  // A sealed memfd the forked "daemon" inherits.
  auto seg = ShmSegment::Create(absl::StrCat("dos_bench_doorbell.", getpid()),
                                sizeof(ControlBlock));
  if (!seg.ok()) {
    std::fprintf(stderr, "%s\n", seg.status().ToString().c_str());
    return 1;
  }
  auto* block = static_cast<ControlBlock*>((*seg)->data());
  ControlBlockChannel::InitBlock(block, /*session_id=*/1, /*daemon_pid=*/0);
  const pid_t client = getpid();
  pid_t daemon = fork();
  if (daemon == 0) _exit(RunDaemon(block, client));
  block->daemon_pid = daemon;

  ControlBlockChannel channel(block);
  Measure(channel, absl::GetFlag(FLAGS_warmup), absl::ZeroDuration());
  std::vector<double> hot = Measure(channel, absl::GetFlag(FLAGS_rounds), absl::ZeroDuration());
  std::vector<double> cold = Measure(channel, absl::GetFlag(FLAGS_idle_rounds),
                                     absl::Microseconds(absl::GetFlag(FLAGS_idle_gap_us)));
  block->closed.store(1, std::memory_order_release);
  waitpid(daemon, nullptr, 0);
  std::vector<double> pipe_us = MeasurePipe(absl::GetFlag(FLAGS_rounds) / 4);
  if (hot.empty() || cold.empty() || pipe_us.empty()) return 1;

  const Stats h = Summarize(hot), c = Summarize(cold), p = Summarize(pipe_us);
  std::printf("dos_bench_doorbell machine=%s commit=%s cpus=%u\n", machine.c_str(), commit.c_str(),
              std::thread::hardware_concurrency());
  std::printf("empty step round trip, back to back (%zu):  %s\n", hot.size(), Line(h).c_str());
  std::printf("after %d us idle, daemon in FUTEX_WAIT (%zu):  %s\n",
              absl::GetFlag(FLAGS_idle_gap_us), cold.size(), Line(c).c_str());
  std::printf("reference, pipe round trip same run (%zu):  %s\n", pipe_us.size(), Line(p).c_str());
  std::printf("limit (DESIGN.md 2): microseconds, not milliseconds\n");

  std::vector<std::string> results;
  auto add = [&](const char* name, double value) {
    results.push_back(
        absl::StrFormat(R"(    {"name": "%s", "value": %.3f, "unit": "us"})", name, value));
  };
  add("empty_step_roundtrip_us_median", h.median);
  add("empty_step_roundtrip_us_p90", h.p90);
  add("empty_step_roundtrip_us_p99", h.p99);
  add("empty_step_roundtrip_us_p999", h.p999);
  add("empty_step_roundtrip_us_mean", h.mean);
  add("wake_from_sleep_roundtrip_us_median", c.median);
  add("wake_from_sleep_roundtrip_us_p99", c.p99);
  add("pipe_roundtrip_us_median", p.median);
  add("pipe_roundtrip_us_p99", p.p99);
  const std::string json = absl::StrFormat(
      "{\n  \"machine\": \"%s\",\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n"
      "  \"results\": [\n%s\n  ]\n}\n",
      machine, date, commit, absl::StrJoin(results, ",\n"));
  const std::string path =
      absl::StrCat(absl::GetFlag(FLAGS_out_dir), "/doorbell_", machine, "_", date, ".json");
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace dos

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return dos::Main();
}
