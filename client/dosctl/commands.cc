#include "client/dosctl/commands.h"

#include <algorithm>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/dosctl/json.h"
#include "client/dosctl/table.h"
#include "dos/wire/socket_access.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace dos::dosctl {
namespace {

// Status's hand-built object (a google.protobuf.Struct: numbers are doubles).
std::string StructJson(const google::protobuf::Struct& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(m, &out, o).ok()) return "{}\n";
  return out;
}

std::string Bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

std::string Num(double v, int digits = 1) { return absl::StrFormat("%.*f", digits, v); }

// "registering: pinning 34.1 GiB of 66.1 GiB, 12.3 GB/s, 3 s left (21 s so far)".
std::string RegisterProgressLine(const v1::RegisterProgress& p) {
  std::string line = absl::StrCat("registering: ", p.phase(), " ", Bytes(p.bytes_done()), " of ",
                                  Bytes(p.bytes_total()));
  const double rate = p.phase_seconds() > 0 ? p.bytes_done() / p.phase_seconds() : 0;
  if (rate > 0) {
    absl::StrAppend(&line, ", ", Num(rate * 1e-9), " GB/s");
    if (p.bytes_total() > p.bytes_done()) {
      absl::StrAppend(&line, ", ", Num((p.bytes_total() - p.bytes_done()) / rate, 0), " s left");
    }
  }
  absl::StrAppend(&line, " (", Num(p.total_seconds(), 0), " s so far)");
  return line;
}

}  // namespace

Commands::Commands(Options options) : options_(std::move(options)) {
  channel_ = grpc::CreateChannel(absl::StrCat("unix:", options_.socket_path),
                                 grpc::InsecureChannelCredentials());
  dos_ = v1::Dos::NewStub(channel_);
  health_ = grpc::health::v1::Health::NewStub(channel_);
}

void Commands::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
}

absl::Status Commands::CheckSocket() const { return CheckDaemonSocket(options_.socket_path); }

absl::Status Commands::FromRpc(const char* call, const grpc::Status& s) const {
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(code, absl::StrCat(call, ": dosd at ", options_.socket_path,
                                           " does not answer (", s.error_message(),
                                           "); is it running? (systemctl status dosd)"));
  }
  // dosd's messages may already name the call ("checkpoint save: ..."): not twice.
  if (absl::StartsWith(s.error_message(), absl::StrCat(call, ":"))) {
    return absl::Status(code, s.error_message());
  }
  return absl::Status(code, absl::StrCat(call, ": ", s.error_message()));
}

absl::Status Commands::Status(std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::ListSessionsResponse list;
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::Status s = dos_->ListSessions(&ctx, v1::ListSessionsRequest(), &list);
    if (!s.ok()) return FromRpc("status", s);
  }
  std::string health;
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health_->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    if (s.ok()) {
      health = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
    } else if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      // No health service registered: the daemon answered ListSessions, which
      // is as much as we can say.
      health = "SERVING (derived: no grpc.health.v1 service, ListSessions answered)";
    } else {
      health = absl::StrCat("UNKNOWN (health check failed: ", s.error_message(), ")");
    }
  }
  if (options_.json) {
    google::protobuf::Struct j;
    auto& f = *j.mutable_fields();
    f["socket"].set_string_value(options_.socket_path);
    f["health"].set_string_value(health);
    f["daemon_pid"].set_number_value(list.daemon_pid());
    f["daemon_version"].set_string_value(list.daemon_version());
    f["sessions"].set_number_value(list.sessions_size());
    out << StructJson(j);
    return absl::OkStatus();
  }
  Table t({"FIELD", "VALUE"});
  t.AddRow({"socket", options_.socket_path});
  t.AddRow({"health", health});
  t.AddRow({"daemon pid", absl::StrCat(list.daemon_pid())});
  t.AddRow({"version", list.daemon_version()});
  t.AddRow({"sessions", absl::StrCat(list.sessions_size())});
  t.Print(out);
  return absl::OkStatus();
}

absl::Status Commands::Sessions(std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::ListSessionsResponse list;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status s = dos_->ListSessions(&ctx, v1::ListSessionsRequest(), &list);
  if (!s.ok()) return FromRpc("sessions", s);
  if (options_.json) {
    out << ToJson(list);
    return absl::OkStatus();
  }
  Table t({"ID", "CLIENT", "PID", "RANK", "STATE", "DEVICE", "TENSORS", "PARAMS", "SUBGROUPS",
           "HOST STATE", "POLICY", "STEPS"},
          {true, false, true, true, false, false, true, true, true, true, false, true});
  for (const auto& x : list.sessions()) {
    t.AddRow({absl::StrCat(x.session_id()), x.client_name(), absl::StrCat(x.pid()),
              x.rank() < 0 ? "-" : absl::StrCat(x.rank(), "/", x.world_size()), x.state(),
              x.device().empty() ? "-" : x.device(), absl::StrCat(x.num_tensors()), absl::StrCat(x.params()),
              absl::StrCat(x.num_subgroups()),
              // Compact state (bf16 moments, 8 bytes a parameter) is marked.
              Bytes(x.host_state_bytes()) +
                  (x.state_format() == v1::STATE_FORMAT_COMPACT ? " compact" : ""),
              x.policy(),
              absl::StrCat(x.steps())});
  }
  t.Print(out);
  // Registrations in flight: a 6B shard's state takes seconds to allocate and pin.
  for (const auto& x : list.sessions()) {
    if (!x.has_register_progress()) continue;
    out << "session " << x.session_id() << " " << RegisterProgressLine(x.register_progress())
        << "\n";
  }
  return absl::OkStatus();
}

absl::Status Commands::Stats(uint64_t session_id, std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::GetStatsRequest req;
  req.set_session_id(session_id);
  v1::GetStatsResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status s = dos_->GetStats(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("stats", s);
  if (options_.json) {
    out << ToJson(resp);
    return absl::OkStatus();
  }
  out << "uptime " << Num(resp.uptime_s()) << " s, host state " << Bytes(resp.host_state_bytes())
      << (resp.host_state_limit_bytes() != 0
              ? absl::StrCat(" of ", Bytes(resp.host_state_limit_bytes()), " allowed")
              : std::string(" (no limit)"))
      << (resp.host_state_viewed_shards() != 0
              ? absl::StrCat("; ", Bytes(resp.host_state_viewed_bytes()), " of it ",
                             resp.host_state_viewed_shards(),
                             " closed session(s)' state a trainer still maps (state_dict())")
              : std::string())
      << "\n";
  for (const auto& e : resp.gpu_engines()) {
    out << "gpu engine cuda:" << e.ordinal() << " " << e.uuid() << " (" << e.name() << "): "
        << e.sessions() << " session(s)";
    if (e.predicted_us() > 0) {
      // Its share of the host and its last step, predicted against measured.
      out << absl::StrFormat(", %s, host share %.2f (own ceiling %.1f GB/s), last step %.3g "
                             "params predicted %s us (%s) measured %s us",
                             e.active() ? "active" : "idle", e.host_share(), e.host_alone_gbps(),
                             static_cast<double>(e.params()), Num(e.predicted_us()),
                             e.binding(), Num(e.measured_us()));
    }
    out << "\n";
  }
  if (resp.has_node() && resp.node().active_engines() > 0) {
    const auto& n = resp.node();
    out << absl::StrFormat("node: %u engine(s) stepping, host %.1f GB/s, CPU %.2f Gparam/s, "
                           "predicted aggregate %.2f Gparam/s\n",
                           n.active_engines(), n.host_gbps(), n.cpu_gparams_per_s(),
                           n.bound_gparams_per_s());
  }
  // The checkpoint store, per owner (each uid's folder) against the quota.
  for (const auto& u : resp.checkpoint_usage()) {
    out << "checkpoints uid " << u.uid() << ": " << Bytes(u.bytes()) << " in " << u.files()
        << " file(s)"
        << (resp.checkpoint_quota_bytes() != 0
                ? absl::StrCat(" of ", Bytes(resp.checkpoint_quota_bytes()), " allowed")
                : std::string(" (no quota)"))
        << "\n";
  }
  Table t({"ID", "STEPS", "SKIPPED", "PARAMS", "PARAMS/S", "LAST WALL US", "CPU US", "GPU US",
           "PREDICTED US", "CPU/GPU/RESIDENT SUBGROUPS", "GPU LEASE", "CKPT STALL MAX US"},
          {true, true, true, true, true, true, true, true, true, true, true, true});
  for (const auto& x : resp.sessions()) {
    const auto& l = x.last_step();
    t.AddRow({absl::StrCat(x.session_id()), absl::StrCat(x.steps()),
              absl::StrCat(x.skipped_steps()), absl::StrCat(x.params()),
              absl::StrFormat("%.3g", x.params_per_second()), Num(l.wall_us()), Num(l.cpu_us()),
              Num(l.gpu_us()), Num(l.predicted_us()),
              absl::StrCat(l.cpu_subgroups(), "/", l.gpu_subgroups(), "/",
                           l.resident_subgroups()),
              // What the trainer lends dosd on its GPU ("-": no lease).
              l.gpu_lease_bytes() != 0 ? Bytes(l.gpu_lease_bytes()) : std::string("-"),
              // Checkpoint stall of the worst step: the lock wait or the
              // copy-on-write copying, whichever was longer.
              Num(std::max(x.lock_wait_us_max(), x.snapshot_wait_us_max()))});
  }
  t.Print(out);
  PrintUidUsage(resp, out);
  return absl::OkStatus();
}

void Commands::PrintUidUsage(const v1::GetStatsResponse& resp, std::ostream& out) {
  if (resp.uids().empty()) return;
  // Each column against its per-uid bound ("-": no cap).
  const v1::UidUsage& cap = resp.uid_limits();
  auto of = [](const std::string& used, uint64_t limit, bool bytes) {
    return absl::StrCat(used, " / ", limit == 0 ? std::string("-")
                                                : bytes ? Bytes(limit) : absl::StrCat(limit));
  };
  out << "\nper uid (used / bound):\n";
  Table t({"UID", "SESSIONS", "MAPPED", "SEGMENTS", "FD CONNECTIONS", "EARLY STEPS", "TENSORS",
           "BOOKKEEPING", "STATE VIEWS", "STATE"},
          {true, true, true, true, true, true, true, true, true, true});
  for (const v1::UidUsage& u : resp.uids()) {
    const std::string sessions =
        u.closed_control_blocks() == 0
            ? absl::StrCat(u.sessions())
            : absl::StrCat(u.sessions(), " (", u.closed_control_blocks(), " closed, mapped)");
    t.AddRow({absl::StrCat(u.uid()), of(sessions, cap.sessions(), false),
              of(Bytes(u.mapped_bytes()), cap.mapped_bytes(), true),
              of(absl::StrCat(u.segments()), cap.segments(), false),
              of(absl::StrCat(u.connections()), cap.connections(), false),
              of(absl::StrCat(u.early_steps()), cap.early_steps(), false),
              of(absl::StrCat(u.tensors()), cap.tensors(), false),
              of(Bytes(u.bookkeeping_bytes()), cap.bookkeeping_bytes(), true),
              of(absl::StrCat(u.state_views()), cap.state_views(), false),
              of(Bytes(u.state_bytes()), cap.state_bytes(), true)});
  }
  t.Print(out);
}

absl::Status Commands::GetPolicy(uint64_t session_id, const std::string& token,
                                 std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::GetPolicyRequest req;
  req.mutable_session()->set_session_id(session_id);
  req.mutable_session()->set_token(token);
  v1::GetPolicyResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status s = dos_->GetPolicy(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("policy get", s);
  if (options_.json) {
    out << ToJson(resp);
  } else {
    out << resp.policy() << '\n';
  }
  return absl::OkStatus();
}

absl::Status Commands::SetPolicy(uint64_t session_id, const std::string& policy,
                                 std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::SetPolicyRequest req;
  req.mutable_session()->set_session_id(session_id);
  req.set_policy(policy);
  v1::SetPolicyResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status s = dos_->SetPolicy(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("policy set", s);
  if (options_.json) {
    out << ToJson(resp);
  } else {
    out << (session_id == 0 ? std::string("default") : absl::StrCat("session ", session_id))
        << " policy: " << resp.policy() << '\n';
  }
  return absl::OkStatus();
}

void Commands::PrintFiles(const google::protobuf::RepeatedPtrField<v1::CheckpointFile>& files,
                          std::ostream& out) const {
  Table t({"SESSION", "STEP", "BYTES", "SNAPSHOT US", "WRITE MS", "STEP WALL US", "PATH"},
          {true, true, true, true, true, true, false});
  for (const auto& f : files) {
    t.AddRow({absl::StrCat(f.session_id()), absl::StrCat(f.step()), Bytes(f.bytes()),
              Num(f.snapshot_us()), Num(f.write_ms()), Num(f.last_step_wall_us()), f.path()});
  }
  t.Print(out);
}

absl::Status Commands::SaveCheckpoint(uint64_t session_id, const std::string& path,
                                      std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::SaveCheckpointRequest req;
  req.set_session_id(session_id);
  req.set_path(path);
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.checkpoint_timeout));
  grpc::Status s = dos_->SaveCheckpoint(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("checkpoint save", s);
  if (options_.json) {
    out << ToJson(resp);
  } else {
    PrintFiles(resp.files(), out);
  }
  return absl::OkStatus();
}

absl::Status Commands::LoadCheckpoint(uint64_t session_id, const std::string& path,
                                      std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::LoadCheckpointRequest req;
  req.mutable_session()->set_session_id(session_id);
  req.set_path(path);
  v1::LoadCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.checkpoint_timeout));
  grpc::Status s = dos_->LoadCheckpoint(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("checkpoint load", s);
  if (options_.json) {
    out << ToJson(resp);
  } else {
    PrintFiles(resp.files(), out);
  }
  return absl::OkStatus();
}

absl::Status Commands::DeleteCheckpoint(const std::string& path, int64_t uid,
                                        std::ostream& out) {
  if (auto st = CheckSocket(); !st.ok()) return st;
  v1::DeleteCheckpointRequest req;
  req.set_path(path);
  if (uid >= 0) req.set_uid(static_cast<uint32_t>(uid));
  v1::DeleteCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.checkpoint_timeout));
  grpc::Status s = dos_->DeleteCheckpoint(&ctx, req, &resp);
  if (!s.ok()) return FromRpc("checkpoint delete", s);
  if (options_.json) {
    out << ToJson(resp);
    return absl::OkStatus();
  }
  for (const std::string& p : resp.paths()) out << "deleted " << p << "\n";
  out << "freed " << Bytes(resp.bytes()) << "; uid " << resp.usage().uid() << " now holds "
      << Bytes(resp.usage().bytes()) << " in " << resp.usage().files() << " file(s)\n";
  return absl::OkStatus();
}

}  // namespace dos::dosctl
