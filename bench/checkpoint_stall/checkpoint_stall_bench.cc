// The checkpoint stall with steps back to back (no forward/backward between
// them, the worst case): the step right after a checkpoint's step boundary,
// with the state read by a writer thread beside it (Session::Snapshot's
// path: ShardState::BeginSnapshot under the lock, SnapshotAcquire and
// SnapshotReleaseBelow on the checkpoint's thread, which here copies each
// subgroup into one scratch buffer instead of a file; the step copies what
// it writes first into --pool_gib of SnapshotPool, then waits), against a
// step with no snapshot, and against the stall of the first design (the
// whole state copied under the session lock). In-process: ShardState,
// StepExecutor and the CPU updater, no dosd and no file write.
// Median of --repeats. Results go to bench/results/checkpoint_stall_<machine>_<date>.json.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dos/wire/dtype.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/sched/step_executor.h"
#include "daemon/state/shard_state.h"

ABSL_FLAG(uint64_t, params, 200'000'000, "parameters in the shard (bf16 weights and grads)");
ABSL_FLAG(uint32_t, subgroups, 20, "subgroups the shard is cut into");
ABSL_FLAG(double, pool_gib, 1024, "SnapshotPool limit (GiB) for the steps' copies");
ABSL_FLAG(int, repeats, 7, "repeats of each measurement (median reported)");
ABSL_FLAG(std::string, machine, "vm-2core", "machine name for the results file");
ABSL_FLAG(std::string, date, "", "date for the results file (default: today, UTC)");
ABSL_FLAG(std::string, out_dir, DOS_SOURCE_DIR "/bench/results", "where the JSON goes");

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Us(absl::Time start) { return absl::ToDoubleMicroseconds(absl::Now() - start); }

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t n = absl::GetFlag(FLAGS_params);
  const uint64_t sg = (n + absl::GetFlag(FLAGS_subgroups) - 1) / absl::GetFlag(FLAGS_subgroups);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));

  dos::HostMemoryBudget budget(0);
  std::vector<dos::TensorDesc> tensors{
      {.name = "w", .param_dtype = dos::DType::kBF16, .grad_dtype = dos::DType::kBF16, .numel = n}};
  std::vector<dos::GroupConfig> groups(1);
  auto shard = dos::ShardState::Create(tensors, groups, sg, &budget, "bench");
  if (!shard.ok()) {
    std::fprintf(stderr, "cannot allocate the state: %s\n",
                 std::string(shard.status().message()).c_str());
    return 1;
  }
  dos::SnapshotPool pool(static_cast<uint64_t>(absl::GetFlag(FLAGS_pool_gib) * (1 << 30)), nullptr);
  std::vector<float> whole(3 * n);                                    // the first design's copy
  std::vector<char> scratch((*shard)->subgroups()[0].state_bytes());  // the "file"
  auto write = [&] {
    const auto count = static_cast<uint32_t>((*shard)->subgroups().size());
    for (uint32_t g = 0; g < count; ++g) {
      const dos::Subgroup& v = (*shard)->SnapshotAcquire(g);
      std::memcpy(scratch.data(), v.master, v.state_bytes());
      (*shard)->SnapshotReleaseBelow(g + 1);
    }
    (*shard)->EndSnapshot();
  };
  std::vector<uint16_t> param(n, 0x3f80), grad(n);
  for (uint64_t i = 0; i < n; ++i) grad[i] = static_cast<uint16_t>(0x3c00 + (i * 7 & 0x1ff));
  std::vector<dos::TensorBinding> bindings{{param.data(), grad.data()}};
  dos::cpu::CpuUpdater cpu(dos::cpu::CpuUpdaterOptions{});
  dos::cpu::HostEngine engine(&cpu);
  dos::StepExecutor executor(&engine);
  dos::StepRequest req{};
  req.num_groups = 1;
  req.grad_scale = 1;
  req.clip_coef = 1;
  req.flags = dos::kStepGradientsChecked;
  req.groups[0] = {1e-3, 0.9, 0.999, 1e-8, 0.01};
  dos::Policy policy;
  auto step = [&] {
    auto out = executor.Run(**shard, bindings, req, policy);
    if (!out.ok()) {
      std::fprintf(stderr, "step failed: %s\n", std::string(out.status().message()).c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < 2; ++i) step();                                          // warm up
  std::memcpy(whole.data(), (*shard)->subgroups()[0].master, scratch.size());  // fault some in

  std::vector<double> plain, locked_copy, cow_step, cow_wait, cow_copy, next_step;
  for (int r = 0; r < repeats; ++r) {
    absl::Time t = absl::Now();
    step();
    plain.push_back(Us(t));
    // The first design: the whole state copied while the step waits.
    t = absl::Now();
    float* to = whole.data();
    for (const dos::Subgroup& from : (*shard)->subgroups()) {
      std::memcpy(to, from.master, from.state_bytes());
      to += 3 * from.numel;
    }
    locked_copy.push_back(Us(t));
    // Copy-on-write: mark the boundary, write on another thread, step at once.
    (*shard)->TakeWriteWaitUs();
    (*shard)->BeginSnapshot(&pool);
    double copy_us = 0;
    std::thread copier([&] {
      const absl::Time c = absl::Now();
      write();
      copy_us = Us(c);
    });
    t = absl::Now();
    step();
    cow_step.push_back(Us(t));
    cow_wait.push_back((*shard)->TakeWriteWaitUs());
    t = absl::Now();
    step();  // the copy is done by the end of the first step; for scale
    next_step.push_back(Us(t));
    copier.join();
    cow_copy.push_back(copy_us);
  }
  const double step_us = Median(plain);
  const double cow_us = Median(cow_step);
  const double state_bytes = static_cast<double>((*shard)->state_bytes());
  struct Fig { const char* name; double value; const char* unit; };
  const Fig figs[] = {
      {"step_us_median", step_us, "us"},
      {"step_with_cow_snapshot_us_median", cow_us, "us"},
      {"cow_stall_us_median", cow_us - step_us, "us"},
      {"cow_stall_fraction_of_step", (cow_us - step_us) / step_us, "ratio"},
      {"cow_step_wait_us_median", Median(cow_wait), "us"},
      {"cow_copy_us_median", Median(cow_copy), "us"},
      {"step_after_us_median", Median(next_step), "us"},
      {"locked_copy_stall_us_median", Median(locked_copy), "us"},
      {"locked_copy_stall_fraction_of_step", Median(locked_copy) / step_us, "ratio"},
      {"locked_copy_gb_per_s", state_bytes / Median(locked_copy) / 1e3, "GB/s"},
  };
  std::printf("params=%llu subgroups=%zu state=%.2f GB threads=%d repeats=%d\n",
              static_cast<unsigned long long>(n), (*shard)->subgroups().size(), state_bytes / 1e9,
              cpu.threads(), repeats);
  for (const Fig& f : figs) std::printf("%-38s %12.3f %s\n", f.name, f.value, f.unit);
  std::printf("target: cow_stall_fraction_of_step < 0.05 (the previous design: %.2f)\n",
              Median(locked_copy) / step_us);

  std::string date = absl::GetFlag(FLAGS_date);
  if (date.empty()) date = absl::FormatTime("%Y-%m-%d", absl::Now(), absl::UTCTimeZone());
  const std::string path = absl::StrFormat("%s/checkpoint_stall_%s_%s.json",
                                           absl::GetFlag(FLAGS_out_dir),
                                           absl::GetFlag(FLAGS_machine), date);
  std::ofstream out(path);
  out << "{\n  \"machine\": \"" << absl::GetFlag(FLAGS_machine) << "\",\n  \"date\": \"" << date
      << "\",\n  \"params\": " << n << ",\n  \"subgroups\": " << (*shard)->subgroups().size()
      << ",\n  \"threads\": " << cpu.threads() << ",\n  \"repeats\": " << repeats
      << ",\n  \"results\": [\n";
  for (size_t i = 0; i < std::size(figs); ++i) {
    out << absl::StrFormat("    {\"name\": \"%s\", \"value\": %.3f, \"unit\": \"%s\"}%s\n",
                           figs[i].name, figs[i].value, figs[i].unit,
                           i + 1 < std::size(figs) ? "," : "");
  }
  out << "  ]\n}\n";
  std::printf("wrote %s\n", path.c_str());
  return 0;
}
