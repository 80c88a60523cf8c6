// dosd: the Deep Optimizer States daemon. Composition root only: parses the
// flags into a DaemonConfig, builds the components, serves gRPC on a unix
// socket, and drains on SIGTERM/SIGINT.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/common/sd_notify.h"
#include "daemon/cpu/cpu_updater.h"
#ifdef DOS_WITH_CUDA
#include "daemon/gpu/gpu_engine.h"
#endif
#include "daemon/rpc/dos_service.h"
#include "daemon/rpc/socket_guard.h"
#include "daemon/sched/step_executor.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_memory_budget.h"

ABSL_FLAG(std::string, socket, "/run/dos/dosd.sock",
          "Unix socket to serve the gRPC control plane on.");
ABSL_FLAG(std::string, socket_mode, "0660", "Permissions of the socket (octal).");
ABSL_FLAG(std::string, host_memory_limit, "0",
          "Cap on host memory held as optimizer state, e.g. 64G, 512M; 0 = no cap.");
ABSL_FLAG(uint64_t, subgroup_size, 100'000'000,
          "Default subgroup size in elements, for clients that do not choose one.");
ABSL_FLAG(int, cpu_threads, 0, "CPU update threads; 0 = every core.");
ABSL_FLAG(uint64_t, cpu_tile, 65536, "Elements per CPU update tile.");
ABSL_FLAG(std::string, cpu_isa, "", "Force a CPU kernel variant: scalar, avx2, avx512.");
ABSL_FLAG(std::string, policy, "auto",
          "Default scheduling policy: cpu, static:<f>, interleave:<k>, auto.");
ABSL_FLAG(int, gpu_device, 0,
          "CUDA device this daemon drives (GPU mode); -1: CPU only. Ignored without CUDA.");
ABSL_FLAG(std::string, gpu_memory_budget, "0",
          "GPU memory `auto` may keep optimizer state resident in, beyond the staging slots, "
          "e.g. 12G; 0 = stream every GPU-path subgroup.");
ABSL_FLAG(double, model_host_gbps, 0,
          "Performance model: host memory GB/s that the CPU kernel and the DMA engines share "
          "(M_host, measured by bench/update's probe); 0 = the built-in figure.");
ABSL_FLAG(int, gpu_staging_slots, 3, "Subgroups in flight on the GPU path (staging slots).");
ABSL_FLAG(bool, gpu_cpu_grad_fp32, false,
          "CPU path in GPU mode: cast 16-bit gradients to fp32 on the GPU before copying them "
          "to the host (twice the PCIe bytes; for measurement).");
ABSL_FLAG(std::string, gpu_timeline, "",
          "Append one JSON line per GPU-mode step (which subgroup ran where, when) to this file.");
ABSL_FLAG(std::string, shm_prefix, "/dos", "Prefix of the daemon's shared-memory names.");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");

namespace dos {
namespace {

constexpr char kVersion[] = "0.1.0";

// Everything the daemon is configured with, one field per flag.
struct DaemonConfig {
  std::string socket_path;           // where clients and dosctl connect
  mode_t socket_mode = 0660;         // permissions of that socket
  uint64_t host_memory_limit = 0;    // bytes of optimizer state; 0 = unlimited
  SessionOptions session;            // control blocks, subgroup size default
  cpu::CpuUpdaterOptions cpu;        // update threads, tile, ISA
  Policy default_policy;             // policy of new sessions
  int gpu_device = 0;                // CUDA device; -1: CPU only
  uint64_t gpu_memory_budget = 0;    // resident-state bytes `auto` may use on the GPU
  int gpu_staging_slots = 3;         // GPU-path subgroups in flight
  double model_host_gbps = 0;        // M_host for the performance model; 0 = built-in
  bool gpu_cpu_grad_fp32 = false;    // CPU path sends fp32 gradients (measurement)
  std::string gpu_timeline;          // per-step placement log; empty: off
  LogLevel log_level = LogLevel::kInfo;
};

bool ParseBytes(absl::string_view text, uint64_t* out) {
  uint64_t mult = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K': case 'k': mult = uint64_t{1} << 10; break;
      case 'M': case 'm': mult = uint64_t{1} << 20; break;
      case 'G': case 'g': mult = uint64_t{1} << 30; break;
      case 'T': case 't': mult = uint64_t{1} << 40; break;
      default: break;
    }
    if (mult != 1) text.remove_suffix(1);
  }
  uint64_t v;
  if (!absl::SimpleAtoi(text, &v)) return false;
  *out = v * mult;
  return true;
}

absl::StatusOr<DaemonConfig> ConfigFromFlags() {
  DaemonConfig c;
  c.socket_path = absl::GetFlag(FLAGS_socket);
  unsigned mode = 0;
  if (!absl::numbers_internal::safe_strtou32_base(absl::GetFlag(FLAGS_socket_mode), &mode, 8) ||
      mode > 0777) {
    return absl::InvalidArgumentError("--socket_mode must be octal permissions such as 0660");
  }
  c.socket_mode = mode;
  if (!ParseBytes(absl::GetFlag(FLAGS_host_memory_limit), &c.host_memory_limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--host_memory_limit=", absl::GetFlag(FLAGS_host_memory_limit),
        " is not a size; write e.g. 64G, 512M or 0 for no cap"));
  }
  c.session.shm_prefix = absl::GetFlag(FLAGS_shm_prefix);
  c.session.default_subgroup_size = absl::GetFlag(FLAGS_subgroup_size);
  if (c.session.default_subgroup_size == 0) {
    return absl::InvalidArgumentError("--subgroup_size must be positive");
  }
  c.cpu.threads = absl::GetFlag(FLAGS_cpu_threads);
  c.cpu.tile_elems = absl::GetFlag(FLAGS_cpu_tile);
  if (c.cpu.threads < 0 || c.cpu.tile_elems == 0) {
    return absl::InvalidArgumentError("--cpu_threads must be >= 0 and --cpu_tile > 0");
  }
  std::string isa = absl::GetFlag(FLAGS_cpu_isa);
  if (!isa.empty()) {
    if (!cpu::ParseIsa(isa, &c.cpu.isa)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cpu_isa=", isa, " is unknown; use scalar, avx2 or avx512"));
    }
    if (!cpu::IsaSupported(c.cpu.isa)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--cpu_isa=", isa, " is not supported by this CPU"));
    }
  }
  absl::StatusOr<Policy> policy = ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) return policy.status();
  c.default_policy = *policy;
  c.gpu_device = absl::GetFlag(FLAGS_gpu_device);
  if (!ParseBytes(absl::GetFlag(FLAGS_gpu_memory_budget), &c.gpu_memory_budget)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_memory_budget=", absl::GetFlag(FLAGS_gpu_memory_budget),
        " is not a size; write e.g. 12G or 0"));
  }
  c.gpu_staging_slots = absl::GetFlag(FLAGS_gpu_staging_slots);
  c.model_host_gbps = absl::GetFlag(FLAGS_model_host_gbps);
  if (c.model_host_gbps < 0) return absl::InvalidArgumentError("--model_host_gbps must be >= 0");
  if (c.gpu_staging_slots < 1) return absl::InvalidArgumentError("--gpu_staging_slots must be >= 1");
  c.gpu_cpu_grad_fp32 = absl::GetFlag(FLAGS_gpu_cpu_grad_fp32);
  c.gpu_timeline = absl::GetFlag(FLAGS_gpu_timeline);
  if (!ParseLogLevel(absl::GetFlag(FLAGS_log_level), &c.log_level)) {
    return absl::InvalidArgumentError("--log_level must be debug, info, warning or error");
  }
  return c;
}

int Fail(absl::string_view event, const absl::Status& status) {
  DOS_LOG_ERROR(event, "error", status.message());
  std::fprintf(stderr, "dosd: %s\n", std::string(status.message()).c_str());
  return 1;
}

int Run(const DaemonConfig& config) {
  SetMinLogLevel(config.log_level);
  // Block the stop signals in every thread; main() takes them with sigwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<std::unique_ptr<SocketGuard>> guard = SocketGuard::Claim(config.socket_path);
  if (!guard.ok()) return Fail("daemon.socket", guard.status());

  HostMemoryBudget budget(config.host_memory_limit);
  cpu::CpuUpdater cpu_updater(config.cpu);
  GpuBackend* gpu = nullptr;
#ifdef DOS_WITH_CUDA
  std::unique_ptr<gpu::GpuEngine> gpu_engine;
  if (config.gpu_device >= 0) {
    gpu::GpuEngineOptions gopt;
    gopt.device = config.gpu_device;
    gopt.staging_slots = config.gpu_staging_slots;
    if (config.model_host_gbps > 0) gopt.model.host_bytes_per_s = config.model_host_gbps * 1e9;
    gopt.resident_budget_bytes = config.gpu_memory_budget;
    gopt.cpu_grad_fp32 = config.gpu_cpu_grad_fp32;
    gopt.timeline_path = config.gpu_timeline;
    absl::StatusOr<std::unique_ptr<gpu::GpuEngine>> engine =
        gpu::GpuEngine::Create(gopt, &cpu_updater);
    if (engine.ok()) {
      gpu_engine = *std::move(engine);
      gpu = gpu_engine.get();
    } else if (engine.status().code() == absl::StatusCode::kUnavailable) {
      DOS_LOG_INFO("daemon.cpu_only", "reason", engine.status().message());
    } else {
      return Fail("daemon.gpu", engine.status());
    }
  }
#endif
  StepExecutor executor(&cpu_updater, gpu);
  SessionManager sessions(config.session, config.default_policy, &executor, &budget);
  DosService service(&sessions, &budget, kVersion);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + config.socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return Fail("daemon.listen",
                absl::UnavailableError(absl::StrCat("cannot listen on unix:", config.socket_path,
                                                    "; check the directory's permissions")));
  }
  if (::chmod(config.socket_path.c_str(), config.socket_mode) != 0) {
    DOS_LOG_WARNING("daemon.chmod_failed", "socket", config.socket_path);
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  // systemd (Type=notify): ready once the socket accepts calls; the watchdog
  // pings only while the session table can be locked (a wedged daemon stops
  // pinging and systemd restarts it). Both are no-ops outside systemd.
  if (absl::Status st = SdNotify("READY=1"); !st.ok()) {
    DOS_LOG_WARNING("daemon.sd_notify_failed", "error", st.message());
  }
  SdWatchdog watchdog([&sessions] {
    sessions.List();
    return true;
  });
  DOS_LOG_INFO("daemon.start", "version", kVersion, "pid", getpid(), "socket",
               config.socket_path, "cpu_threads", cpu_updater.threads(), "cpu_isa",
               cpu::IsaName(cpu_updater.isa()), "policy", FormatPolicy(config.default_policy),
               "host_memory_limit", config.host_memory_limit, "gpu", gpu != nullptr);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  DOS_LOG_INFO("daemon.stopping", "signal", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  SdNotify("STOPPING=1").IgnoreError();
  server->GetHealthCheckService()->SetServingStatus(false);
  // Stop taking calls, then drain: each session finishes its in-flight step.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  sessions.Shutdown();
  server->Wait();
  DOS_LOG_INFO("daemon.stopped");
  return 0;
}

}  // namespace
}  // namespace dos

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Deep Optimizer States daemon: holds optimizer state for the trainers on this node.\n"
      "  dosd [--socket=/run/dos/dosd.sock] [--flagfile=/etc/dos/dosd.flags] ...");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<dos::DaemonConfig> config = dos::ConfigFromFlags();
  if (!config.ok()) return dos::Fail("daemon.config", config.status());
  return dos::Run(*config);
}
