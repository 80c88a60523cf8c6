// dosd: the Deep Optimizer States daemon. Composition root only: parses the
// flags into a DaemonConfig, builds the components, serves gRPC on a unix
// socket, and drains on SIGTERM/SIGINT/SIGHUP.
#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/bounds_flags.h"
#include "daemon/common/log.h"
#include "daemon/common/sd_notify.h"
#include "daemon/cpu/cpu_updater.h"
#include "daemon/delayed_flags.h"
#include "daemon/engines.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/metrics/metrics_http_server.h"
#include "daemon/metrics/metrics_registry.h"
#include "daemon/rpc/dos_service.h"
#include "daemon/rpc/session_ports.h"
#include "daemon/rpc/socket_guard.h"
#include "daemon/rpc/unix_listener.h"
#include "daemon/sched/device_selection.h"
#include "daemon/sched/executor_set.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_guard.h"
#include "daemon/state/host_memory_budget.h"
#include "dos/cli/cli.h"
#include "dos/version.h"

ABSL_FLAG(std::string, socket, "/run/dos/dosd.sock",
          "Unix socket to serve the gRPC control plane on.");
ABSL_FLAG(std::string, socket_mode, "0660", "Permissions of the socket (octal).");
ABSL_FLAG(std::string, host_memory_limit, "0",
          "Cap on host memory held as optimizer state and the delayed update's buffers "
          "(clients with delay=1), e.g. 64G, 512M; 0 = no cap.");
ABSL_FLAG(uint64_t, subgroup_size, 100'000'000,
          "Default subgroup size in elements, for clients that do not choose one.");
ABSL_FLAG(int, cpu_threads, 0, "CPU update threads; 0 = every core.");
ABSL_FLAG(uint64_t, cpu_tile, 65536, "Elements per CPU update tile.");
ABSL_FLAG(std::string, cpu_isa, "", "Force a CPU kernel variant: scalar, avx2, avx512.");
ABSL_FLAG(std::string, policy, "auto",
          "Default scheduling policy: cpu, static:<f>, interleave:<k>, auto.");
ABSL_FLAG(std::string, gpu_devices, "all",
          "CUDA devices to run a GPU engine on (GPU mode): all, none, or ordinals such as 0,1. "
          "A session runs on the engine of the device its tensors live on (matched by UUID). "
          "Ignored without CUDA.");
ABSL_FLAG(std::string, gpu_device, "",
          "Deprecated: use --gpu_devices. N drives device N only; -1: none.");
ABSL_FLAG(std::string, gpu_memory_budget, "0",
          "Optional node-wide cap (per GPU) on resident optimizer state, beyond the staging "
          "slots, e.g. 12G. Trainers lend dosd GPU memory per session (their GPU lease, sent by "
          "dos.torch from their budget and peak); with this set all sessions on a GPU together "
          "keep at most this much, shared in proportion. Sessions without a lease: their "
          "resident budget; 0 = no cap (and nothing resident for them).");
ABSL_FLAG(double, model_host_gbps, 0,
          "Performance model: host memory GB/s that the CPU kernel and the DMA engines share "
          "(M_host, measured by bench/update's probe); 0 = the built-in figure.");
ABSL_FLAG(int, gpu_staging_slots, 2,
          "Subgroups in flight on the GPU path (staging slots): one loads while the other is "
          "written back. A third bought nothing at 6B on nvidia-h200 (0.728 s/iter against 0.695 "
          "with two, whose freed 1.2 GB went to the resident tier).");
ABSL_FLAG(bool, gpu_prefetch, false,
          "Copy the first streamed subgroups' state into the staging slots while backward still "
          "runs (before the step's inf/NaN verdict). Off by default: at 6B on the H200 it measured "
          "3% slower, and on 2026-12-01 the same as without it within the noise "
          "(bench/e2e/README.md).");
ABSL_FLAG(bool, gpu_cpu_grad_fp32, false,
          "CPU path in GPU mode: cast 16-bit gradients to fp32 on the GPU before copying them "
          "to the host (twice the PCIe bytes; for measurement).");
ABSL_FLAG(std::string, gpu_cpu_path_copy, "kernel",
          "CPU path in GPU mode: how gradients reach the host and new weights the GPU. kernel: "
          "copied by a kernel on streams of their own; dma: by the copy engines, queued behind "
          "the GPU path's state copies (the behaviour before; for measurement).");
ABSL_FLAG(std::string, gpu_timeline, "",
          "Append one JSON line per GPU-mode step (which subgroup ran where, when) to this file "
          "(with several GPU engines: to FILE.cuda<ordinal>, one per engine).");
ABSL_FLAG(bool, state_huge_pages, true,
          "Transparent huge pages (madvise) for shards of 64 MiB of state or more.");
ABSL_FLAG(std::string, shm_prefix, "", "Ignored (dosd names nothing in /dev/shm).");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");
ABSL_FLAG(std::string, checkpoint_dir, "auto",
          "Directory every checkpoint lives under (SaveCheckpoint/LoadCheckpoint paths are "
          "relative to it); scanned at startup for state to restore; empty: checkpoints off. "
          "auto: the user's own $XDG_STATE_HOME/dos/checkpoints (else "
          "~/.local/state/dos/checkpoints), never the system folder: the packaged service's "
          "flagfile sets /var/lib/dos/checkpoints.");
ABSL_FLAG(absl::Duration, autosave_interval, absl::ZeroDuration(),
          "Checkpoint every registered session this often (e.g. 10m); 0 = off.");
ABSL_FLAG(int, autosave_keep, 2, "Autosaves kept per (client name, rank).");
ABSL_FLAG(std::string, checkpoint_staging_limit, "auto",
          "Host memory steps may copy state into while a checkpoint is written (each subgroup "
          "they are about to update before the file reaches it; freed once written; also "
          "charged to --host_memory_limit; only where the host and dosd's memory cgroup have "
          "room). Past it a step waits for the write instead. auto: a quarter of the host's "
          "memory; 0: steps always wait.");
ABSL_FLAG(bool, restore, true,
          "At startup, offer each (client name, rank)'s latest checkpoint to the first trainer "
          "that attaches with that name and rank and registers a matching layout.");
ABSL_FLAG(std::string, session_memory_limit, "0",
          "Cap on one session's optimizer state (12 bytes per parameter) and, with delay=1, "
          "its delayed update's capture buffers, e.g. 16G; 0 = none.");
ABSL_FLAG(std::string, group, "",
          "Group given the socket and the descriptor socket <socket>.fd beside it (with "
          "--socket_mode 0660: the trainers' group); empty: the daemon's own group.");
ABSL_FLAG(std::string, allow_uids, "",
          "Comma-separated uids allowed to attach (the attaching process's credentials from the "
          "kernel, on the descriptor socket <socket>.fd); with --allow_gids empty too: no check "
          "beyond the sockets' file mode.");
ABSL_FLAG(std::string, allow_gids, "",
          "Comma-separated gids (primary or supplementary) allowed to attach.");
ABSL_FLAG(std::string, tcp_listen, "",
          "Also serve gRPC on HOST:PORT over TCP (e.g. 127.0.0.1:7070); empty = unix socket only. "
          "TCP callers carry no identity: they may only read (stats, sessions, policies) "
          "unless --tcp_operator_calls, and cannot attach; a non-loopback HOST is refused "
          "unless --tcp_allow_remote.");
ABSL_FLAG(std::string, operator_gids, "",
          "Groups (names or gids, comma-separated) whose members are operators: they act on "
          "every session. Root and dosd's own uid always are.");
ABSL_FLAG(bool, tcp_operator_calls, false,
          "Let --tcp_listen callers (no identity) make operator calls; off: they only read.");
ABSL_FLAG(bool, tcp_allow_remote, false,
          "Allow --tcp_listen on a non-loopback address: anyone who reaches it can read stats, "
          "sessions and policies, and with --tcp_operator_calls also make operator calls.");
ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics at http://127.0.0.1:PORT/metrics; 0 = off.");
ABSL_FLAG(absl::Duration, session_lease, absl::Seconds(60),
          "How long the state of a trainer that died stays for it to re-attach (resume) "
          "before it is freed; 0 = free at once.");

namespace dos {
namespace {

constexpr char kVersion[] = DOS_VERSION_STRING;

// Everything the daemon is configured with, one field per flag.
struct DaemonConfig {
  std::string socket_path;           // where clients and dosctl connect
  mode_t socket_mode = 0660;         // permissions of that socket
  uint64_t host_memory_limit = 0;    // bytes of optimizer state and delayed buffers; 0 = unlimited
  SessionOptions session;            // control blocks, subgroup size default
  EnginesConfig engines;             // CPU updater (threads, tile, ISA), GPU engines
  Policy default_policy;             // policy of new sessions
  LogLevel log_level = LogLevel::kInfo;
  bool checkpoints = true;           // false: --checkpoint_dir is empty
  CheckpointerOptions checkpoint;    // directory, autosave, restore
  absl::Duration session_lease;      // dead trainers' state kept this long
  gid_t group = static_cast<gid_t>(-1);  // socket and shm group; -1: unchanged
  int metrics_port = 0;              // loopback Prometheus endpoint; 0 = off
  std::string tcp_listen;            // extra gRPC listener HOST:PORT; empty: none
  AuthorizerOptions authz;           // operators; what TCP callers may do
  UidLimits uid_limits;              // per-uid and per-session bounds (bounds_flags.h)
  uint32_t fd_reserve = 256;         // descriptors kept for uids without sessions
};

// The GPU engines' and planners' flags.
absl::Status GpuFlags(DaemonConfig& c) {
  absl::StatusOr<GpuDeviceSelection> devices =
      GpuDevicesFromFlags(absl::GetFlag(FLAGS_gpu_devices), absl::GetFlag(FLAGS_gpu_device));
  if (!devices.ok()) return devices.status();
  c.engines.gpu_devices = *std::move(devices);
  if (!ParseBytes(absl::GetFlag(FLAGS_gpu_memory_budget), &c.engines.gpu_memory_budget)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_memory_budget=", absl::GetFlag(FLAGS_gpu_memory_budget),
        " is not a size; write e.g. 12G or 0"));
  }
  c.engines.gpu_staging_slots = absl::GetFlag(FLAGS_gpu_staging_slots);
  c.engines.gpu_prefetch = absl::GetFlag(FLAGS_gpu_prefetch);
  c.engines.model_host_gbps = absl::GetFlag(FLAGS_model_host_gbps);
  if (c.engines.model_host_gbps < 0) {
    return absl::InvalidArgumentError("--model_host_gbps must be >= 0");
  }
  if (c.engines.gpu_staging_slots < 1) {
    return absl::InvalidArgumentError("--gpu_staging_slots must be >= 1");
  }
  c.engines.gpu_cpu_grad_fp32 = absl::GetFlag(FLAGS_gpu_cpu_grad_fp32);
  const std::string copy = absl::GetFlag(FLAGS_gpu_cpu_path_copy);
  if (copy != "kernel" && copy != "dma") {
    return absl::InvalidArgumentError(absl::StrCat("--gpu_cpu_path_copy=", copy,
                                                   " is not one of: kernel, dma"));
  }
  c.engines.gpu_cpu_copy_kernel = copy == "kernel";
  c.engines.gpu_timeline = absl::GetFlag(FLAGS_gpu_timeline);
  return absl::OkStatus();
}

// Who may use the daemon: the socket's group, the Attach allow lists, the TCP listener.

absl::Status AccessFlags(DaemonConfig& c) {
  if (const std::string g = absl::GetFlag(FLAGS_group); !g.empty()) {
    struct group* gr = ::getgrnam(g.c_str());
    unsigned gid = 0;
    if (gr != nullptr) {
      c.group = gr->gr_gid;
    } else if (absl::SimpleAtoi(g, &gid)) {
      c.group = gid;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--group=", g, " is not a known group"));
    }
  }
  std::vector<uint32_t> ids;
  if (!ParseIdList(absl::GetFlag(FLAGS_allow_uids), &ids)) {
    return absl::InvalidArgumentError("--allow_uids must be a comma-separated list of uids");
  }
  c.authz.allow_uids.assign(ids.begin(), ids.end());
  if (!ParseIdList(absl::GetFlag(FLAGS_allow_gids), &ids)) {
    return absl::InvalidArgumentError("--allow_gids must be a comma-separated list of gids");
  }
  c.authz.allow_gids.assign(ids.begin(), ids.end());
  if (!ParseGroupList(absl::GetFlag(FLAGS_operator_gids), &c.authz.operator_gids)) {
    return absl::InvalidArgumentError(absl::StrCat("--operator_gids=", absl::GetFlag(FLAGS_operator_gids),
                                                   " must be comma-separated group names or gids"));
  }
  c.authz.tcp_operator_calls = absl::GetFlag(FLAGS_tcp_operator_calls);
  c.authz.daemon_uid = ::geteuid();
  c.tcp_listen = absl::GetFlag(FLAGS_tcp_listen);
  if (!c.tcp_listen.empty()) {
    const size_t colon = c.tcp_listen.rfind(':');
    std::string host = colon == std::string::npos ? "" : c.tcp_listen.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    uint32_t port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(c.tcp_listen.substr(colon + 1), &port) || port == 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tcp_listen=", c.tcp_listen, " is not HOST:PORT, e.g. 127.0.0.1:7070"));
    }
    if (!IsLoopbackHost(host) && !absl::GetFlag(FLAGS_tcp_allow_remote)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tcp_listen=", c.tcp_listen, " is not a loopback address; TCP callers cannot be "
          "identified, so dosd listens remotely only with --tcp_allow_remote"));
    }
  }
  return absl::OkStatus();
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
  c.session.huge_pages = absl::GetFlag(FLAGS_state_huge_pages);
  c.session.default_subgroup_size = absl::GetFlag(FLAGS_subgroup_size);
  if (c.session.default_subgroup_size == 0) {
    return absl::InvalidArgumentError("--subgroup_size must be positive");
  }
  c.engines.cpu.threads = absl::GetFlag(FLAGS_cpu_threads);
  c.engines.cpu.tile_elems = absl::GetFlag(FLAGS_cpu_tile);
  if (absl::Status st = DelayedFromFlags(&c.engines); !st.ok()) return st;
  if (c.engines.cpu.threads < 0 || c.engines.cpu.tile_elems == 0) {
    return absl::InvalidArgumentError("--cpu_threads must be >= 0 and --cpu_tile > 0");
  }
  std::string isa = absl::GetFlag(FLAGS_cpu_isa);
  if (!isa.empty()) {
    if (!cpu::ParseIsa(isa, &c.engines.cpu.isa)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cpu_isa=", isa, " is unknown; use scalar, avx2 or avx512"));
    }
    if (!cpu::IsaSupported(c.engines.cpu.isa)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--cpu_isa=", isa, " is not supported by this CPU"));
    }
  }
  absl::StatusOr<Policy> policy = ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) return policy.status();
  c.default_policy = *policy;
  if (absl::Status st = GpuFlags(c); !st.ok()) return st;
  if (!ParseLogLevel(absl::GetFlag(FLAGS_log_level), &c.log_level)) {
    return absl::InvalidArgumentError("--log_level must be debug, info, warning or error");
  }
  // auto: a dosd started by hand or by a test writes under its user's state
  // folder; only the packaged service's flagfile names /var/lib/dos.
  c.checkpoint.dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (c.checkpoint.dir == "auto") c.checkpoint.dir = cli::UserStateDir("dos/checkpoints");
  c.checkpoints = !c.checkpoint.dir.empty();
  c.checkpoint.autosave_interval = absl::GetFlag(FLAGS_autosave_interval);
  c.checkpoint.autosave_keep = absl::GetFlag(FLAGS_autosave_keep);
  c.checkpoint.restore = absl::GetFlag(FLAGS_restore);
  if (const std::string limit = absl::GetFlag(FLAGS_checkpoint_staging_limit);
      limit != "auto" && !ParseBytes(limit, &c.checkpoint.staging_limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_staging_limit=", limit, " is not a size; give auto, bytes or 64G, 512M"));
  }
  if (c.checkpoint.autosave_interval < absl::ZeroDuration() || c.checkpoint.autosave_keep < 1) {
    return absl::InvalidArgumentError("--autosave_interval must be >= 0 and --autosave_keep >= 1");
  }
  if (c.checkpoint.autosave_interval > absl::ZeroDuration() && !c.checkpoints) {
    return absl::InvalidArgumentError("--autosave_interval needs a --checkpoint_dir");
  }
  if (absl::Status st = StoreBoundsFromFlags(&c.checkpoint.folders, &c.fd_reserve); !st.ok()) {
    return st;
  }
  if (!ParseBytes(absl::GetFlag(FLAGS_session_memory_limit), &c.session.memory_limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--session_memory_limit=", absl::GetFlag(FLAGS_session_memory_limit),
        " is not a size; write e.g. 16G or 0"));
  }
  if (absl::Status st = AccessFlags(c); !st.ok()) return st;
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (c.metrics_port < 0 || c.metrics_port > 65535) {
    return absl::InvalidArgumentError("--metrics_port must be in [0, 65535]");
  }
  c.session_lease = absl::GetFlag(FLAGS_session_lease);
  if (c.session_lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session_lease must be >= 0");
  }
  if (absl::Status st = BoundsFromFlags(c.host_memory_limit, c.session_lease, &c.session,
                                        &c.uid_limits);
      !st.ok()) {
    return st;
  }
  return c;
}

int Fail(absl::string_view event, const absl::Status& status) {
  DOS_LOG_ERROR(event, "error", status.message());
  std::fprintf(stderr, "dosd: %s\n", std::string(status.message()).c_str());
  return 1;
}

// Concurrent calls one gRPC connection may have open (more queue in the client).
constexpr int kMaxStreamsPerConnection = 16;

// The gRPC server on the unix socket (and --tcp_listen), the socket given
// --socket_mode and --group. On failure `*event` names the log event.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const DaemonConfig& config,
                                                          DosService* service,
                                                          std::string* event) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // The unix socket is dosd's own (UnixListener): gRPC gets its connections
  // one by one, with the caller's kernel identity recorded.
  if (!config.tcp_listen.empty()) {
    builder.AddListeningPort(config.tcp_listen, grpc::InsecureServerCredentials());
  }
  // Bounds on what a connection can make dosd buffer before any handler (and
  // so any identity check or per-uid bound) runs: a few streams at a time,
  // each with the initial 64 KiB flow-control window that gRPC would
  // otherwise grow (BDP probing) to megabytes per stream; partial messages
  // held open on many streams grew dosd by gigabytes. dosd's calls are small
  // and their clients few, so neither costs them anything.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 * 1024);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    *event = "daemon.listen";
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on unix:", config.socket_path,
        config.tcp_listen.empty() ? "" : " or tcp " + config.tcp_listen,
        "; check the directory's permissions and that the port is free"));
  }
  return server;
}

// The Prometheus endpoint on --metrics_port (null when off).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetrics(const DaemonConfig& config,
                                                                MetricsRegistry* metrics) {
  if (config.metrics_port == 0) return std::unique_ptr<MetricsHttpServer>();
  MetricsHttpOptions mopt;
  mopt.port = static_cast<uint16_t>(config.metrics_port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> m =
      MetricsHttpServer::Start(mopt, [metrics] { return metrics->RenderText(); });
  if (!m.ok()) return m.status();
  DOS_LOG_INFO("daemon.metrics", "url",
               absl::StrCat("http://127.0.0.1:", (*m)->port(), "/metrics"));
  return m;
}

// SIGTERM/SIGINT/SIGHUP: stop taking calls, then drain: each session finishes its
// in-flight step. Calls in flight get a second to answer; after that gRPC
// cancels them (their handlers still run to the end before Wait() returns, so
// nothing they write is lost). Debian's gRPC also holds Shutdown until the
// deadline while a client keeps an idle channel open, so a long deadline would
// only delay every stop of a daemon with trainers attached.
void Drain(const DaemonConfig& config, grpc::Server* server, UnixListener* listener,
           Checkpointer* checkpointer, SessionManager* sessions) {
  SdNotify("STOPPING=1").IgnoreError();
  server->GetHealthCheckService()->SetServingStatus(false);
  listener->Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (checkpointer != nullptr) {
    // With autosave on, a clean stop (upgrade, reboot) saves every session
    // so the restarted daemon restores it.
    if (config.checkpoint.autosave_interval > absl::ZeroDuration()) {
      sessions->StopTakingSteps();  // a stalled trainer's early step ends, nothing applied
      absl::StatusOr<std::vector<CheckpointRecord>> saved = checkpointer->Save(0, "");
      DOS_LOG_INFO("daemon.final_checkpoint", "ok", saved.ok(), "files",
                   saved.ok() ? saved->size() : 0, "error",
                   saved.ok() ? "" : saved.status().message());
    }
    checkpointer->Stop();
  }
  sessions->Shutdown();
  server->Wait();
}

// The checkpointer, or null with `*off` saying why and the fix (the
// checkpoint calls answer FAILED_PRECONDITION with it): a daemon without a
// usable checkpoint folder still serves training. An error (dosd does not
// start) only for a store others could write: users' state is at stake.
absl::StatusOr<std::unique_ptr<Checkpointer>> StartCheckpointer(const DaemonConfig& config,
                                                                SessionManager* sessions,
                                                                MetricsRegistry* metrics,
                                                                HostMemoryBudget* budget,
                                                                std::string* off) {
  if (!config.checkpoints) {
    *off = "dosd runs with --checkpoint_dir empty; restart it with --checkpoint_dir=DIR (a "
           "folder its user can write) to save and load checkpoints";
    return nullptr;
  }
  CheckpointerOptions options = config.checkpoint;
  options.folders.on_usage = CheckpointUsageGauges(metrics, options.folders.quota_bytes);
  options.host_budget = budget;
  if (options.autosave_interval > absl::ZeroDuration() &&
      options.autosave_interval < absl::Minutes(1)) {
    // Allowed (tests and short jobs), but each autosave writes every changed
    // session's whole state: 12 bytes a parameter at every step of a 7B job.
    DOS_LOG_WARNING("checkpoint.autosave_interval_short", "interval",
                    absl::FormatDuration(options.autosave_interval), "hint",
                    "each autosave writes the whole state of every session that stepped; "
                    "a training node wants minutes (e.g. --autosave_interval=15m)");
  }
  auto checkpointer = std::make_unique<Checkpointer>(options, sessions);
  if (absl::Status st = checkpointer->Start(); !st.ok()) {
    if (absl::IsPermissionDenied(st)) return st;
    DOS_LOG_WARNING("daemon.checkpoints_off", "error", st.message());
    *off = absl::StrCat(st.message(), ", then restart dosd");
    return nullptr;
  }
  return checkpointer;
}

// The stop signals, blocked in every thread from here on (Run takes them
// with sigwait); SIGXFSZ ignored: a file size limit (systemd LimitFSIZE=,
// ulimit -f) fails a checkpoint write with EFBIG, reported to its caller,
// instead of killing dosd; SIGIO ignored: the lease that tells whether a
// closed session's state is still viewed (HostMemoryBudget) is held for an
// instant, and a break of it must not kill dosd.
sigset_t BlockStopSignals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  // A closed terminal (dosd started by hand with &) stops it the same way:
  // drained, autosaved, its files removed; there is no reload to ask for.
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGXFSZ, SIG_IGN);
  ::signal(SIGIO, SIG_IGN);
  return stop_signals;
}

// Once everything is up: the socket accepts calls (tests and operators take
// an accepting socket for a ready daemon), health says SERVING and systemd
// (Type=notify, a no-op outside systemd) hears READY.
absl::Status AnnounceReady(UnixListener* listener, grpc::Server* server) {
  if (absl::Status st = listener->Serve(server); !st.ok()) return st;
  server->GetHealthCheckService()->SetServingStatus(true);
  if (absl::Status st = SdNotify("READY=1"); !st.ok()) {
    DOS_LOG_WARNING("daemon.sd_notify_failed", "error", st.message());
  }
  return absl::OkStatus();
}

void LogStart(const DaemonConfig& config, const Engines& engines) {
  DOS_LOG_INFO("daemon.start", "version", kVersion, "pid", getpid(), "socket",
               config.socket_path, "cpu_threads", engines.cpu_updater().threads(),
               "delayed_cpu_threads", engines.delayed_updater().threads(), "cpu_isa",
               cpu::IsaName(engines.cpu_updater().isa()), "policy",
               FormatPolicy(config.default_policy), "host_memory_limit",
               config.host_memory_limit, "gpu_engines",
               DescribeDevices(engines.executors().devices()), "session_lease",
               absl::FormatDuration(config.session_lease), "checkpoint_dir",
               config.checkpoint.dir, "tcp_listen", config.tcp_listen);
}

int Run(const DaemonConfig& config) {
  SetMinLogLevel(config.log_level);
  const sigset_t stop_signals = BlockStopSignals();
  absl::StatusOr<std::unique_ptr<SocketGuard>> guard = SocketGuard::Claim(config.socket_path);
  if (!guard.ok()) return Fail("daemon.socket", guard.status());

  // The ledger outlives the budget: the budget keeps uids' state-views
  // charges while closed sessions' state is still mapped.
  UidLedger ledger(config.uid_limits);
  HostMemoryBudget budget(config.host_memory_limit);
  absl::StatusOr<std::unique_ptr<Engines>> engines = Engines::Create(config.engines);
  if (!engines.ok()) return Fail("daemon.gpu", engines.status());
  DaemonCounters counters;
  SessionOptions session_options = config.session;
  session_options.counters = &counters;
  session_options.ledger = &ledger;
  SessionManager sessions(session_options, config.default_policy, (*engines)->executors(),
                          &budget, config.session_lease);
  MetricsRegistry metrics;
  RegisterMetrics(&metrics, &counters, &sessions, &budget);
  std::string checkpoints_off;
  absl::StatusOr<std::unique_ptr<Checkpointer>> checkpointer =
      StartCheckpointer(config, &sessions, &metrics, &budget, &checkpoints_off);
  if (!checkpointer.ok()) return Fail("daemon.checkpoint_dir", checkpointer.status());
  // Development builds before the descriptor socket also served
  // <socket>.auth; a file one left behind would only mislead.
  ::unlink((config.socket_path + ".auth").c_str());
  auto descriptors = StartDescriptorSocket(fdproto::SocketPathFor(config.socket_path),
                                          config.socket_mode, config.group, &sessions, &ledger,
                                          config.fd_reserve);
  if (!descriptors.ok()) return Fail("daemon.fd_socket", descriptors.status());
  // dosd accepts its gRPC socket itself: each connection's kernel identity
  // (SO_PEERCRED) is recorded, and every call is checked against it.
  PeerTable peers;
  Authorizer authorizer(config.authz);
  DosService service(&sessions, &budget, kVersion, checkpointer->get(), descriptors->get(), &peers,
                     &authorizer, checkpoints_off);
  auto listener = UnixListener::Bind(config.socket_path, config.socket_mode, config.group, &peers,
                                     config.session.max_sessions_per_uid);
  if (!listener.ok()) return Fail("daemon.listen", listener.status());

  std::string failed_event;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer(config, &service, &failed_event);
  if (!server.ok()) return Fail(failed_event.c_str(), server.status());
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_server =
      StartMetrics(config, &metrics);
  if (!metrics_server.ok()) return Fail("daemon.metrics", metrics_server.status());
  if (absl::Status st = AnnounceReady(listener->get(), server->get()); !st.ok()) {
    return Fail("daemon.listen", st);
  }
  // The watchdog pings only while the session table can be locked (a wedged
  // daemon stops pinging and systemd restarts it); a no-op outside systemd.
  SdWatchdog watchdog([&sessions] {
    sessions.List();
    return true;
  });
  LogStart(config, **engines);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  DOS_LOG_INFO("daemon.stopping", "signal",
               sig == SIGTERM ? "SIGTERM" : (sig == SIGINT ? "SIGINT" : "SIGHUP"));
  Drain(config, server->get(), listener->get(), checkpointer->get(), &sessions);
  log_internal::FlushSuppressed();
  DOS_LOG_INFO("daemon.stopped");
  return 0;
}

}  // namespace
}  // namespace dos

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "dosd: the Deep Optimizer States daemon; holds the optimizer state of the trainers on "
      "this node.\n"
      "usage: dosd [--flagfile=/etc/dos/dosd.flags] [--socket=PATH] [FLAG...]\n"
      "The packaged service runs `dosd --flagfile=/etc/dos/dosd.flags` (systemctl start dosd).";
  absl::SetProgramUsageMessage(kUsage);
  if (int rc = dos::cli::HandleEarlyArgs(argc, argv, "dosd", kUsage, "daemon/");
      rc >= 0) {
    return rc;
  }
  const std::vector<std::string> overridden = dos::cli::FlagfileOverrides(argc, argv);
  absl::ParseCommandLine(argc, argv);
  for (const std::string& w : overridden) {
    DOS_LOG_WARNING("daemon.flag_overridden", "message", w);
  }
  absl::StatusOr<dos::DaemonConfig> config = dos::ConfigFromFlags();
  if (!config.ok()) return dos::Fail("daemon.config", config.status());
  dos::LowerOomScore();  // a trainer's memory use must never take dosd down
  return dos::Run(*config);
}
