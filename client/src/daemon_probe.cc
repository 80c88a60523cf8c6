#include "daemon_probe.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "dos/wire/control_block.h"
#include "dos/wire/socket_access.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace dos::client {

const char* ClientRelease() { return DOS_CLIENT_RELEASE; }
uint32_t ClientProtocolVersion() { return kProtocolVersion; }

absl::StatusOr<DaemonInfo> ProbeDaemon(const std::string& socket_path, int64_t timeout_ms) {
  if (absl::Status st = CheckDaemonSocket(socket_path); !st.ok()) return st;
  auto channel = grpc::CreateChannel(absl::StrCat("unix:", socket_path),
                                     grpc::InsecureChannelCredentials());
  auto deadline = [&] {
    return std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
  };
  DaemonInfo info;
  {
    auto dos = v1::Dos::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    v1::ListSessionsResponse resp;
    grpc::Status s = dos->ListSessions(&ctx, v1::ListSessionsRequest(), &resp);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
          s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return absl::UnavailableError(absl::StrCat(
            "dosd does not answer at unix:", socket_path, " (", s.error_message(),
            "); the socket may be stale (a killed daemon): restart dosd (systemctl restart "
            "dosd)"));
      }
      if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
        return absl::PermissionDeniedError(absl::StrCat(
            "dosd at ", socket_path, " refused: ", s.error_message(),
            "; run as a member of the socket's group (dos)"));
      }
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("dosd at ", socket_path, ": ", s.error_message()));
    }
    info.pid = resp.daemon_pid();
    info.version = resp.daemon_version();
    info.protocol_version = resp.protocol_version();
    info.sessions = static_cast<uint32_t>(resp.sessions_size());
  }
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline());
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  info.health = s.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())
                       : absl::StrCat("UNKNOWN (", s.error_message(), ")");
  return info;
}

}  // namespace dos::client
