// Commands: dosctl's subcommands over the daemon's gRPC control plane
// (dos.v1.Dos and grpc.health.v1.Health).
//
// Each command writes its answer to `out`, readable (aligned tables) or as
// JSON (protobuf's JSON printer, proto field names), and returns a Status
// whose message names the socket and what to do when the daemon is down or
// its socket refuses this user (CheckDaemonSocket, dos/wire/socket_access.h).
//
// Operator calls carry no session token: `policy get/set`, `stats` and
// `checkpoint` send session_id with an empty token; dosd lets the session's
// own uid and operators (root, dosd's user, --operator_gids) act on it, by
// the caller's kernel identity on the socket.
//
// Thread-safety: one Commands per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace dos::dosctl {

struct Options {
  std::string socket_path;
  bool json = false;
  absl::Duration timeout = absl::Seconds(5);
  absl::Duration checkpoint_timeout = absl::Minutes(30);  // save/load of large state
};

class Commands {
 public:
  explicit Commands(Options options);

  absl::Status Status(std::ostream& out);
  absl::Status Sessions(std::ostream& out);
  // session_id 0: every session.
  absl::Status Stats(uint64_t session_id, std::ostream& out);
  absl::Status GetPolicy(uint64_t session_id, const std::string& token, std::ostream& out);
  // session_id 0: the daemon's default for new sessions.
  absl::Status SetPolicy(uint64_t session_id, const std::string& policy, std::ostream& out);
  // session_id 0: every session. `path` is relative to dosd's --checkpoint_dir.
  absl::Status SaveCheckpoint(uint64_t session_id, const std::string& path, std::ostream& out);
  absl::Status LoadCheckpoint(uint64_t session_id, const std::string& path, std::ostream& out);
  // `path` relative to uid's folder of the store; uid < 0: the caller's own.
  absl::Status DeleteCheckpoint(const std::string& path, int64_t uid, std::ostream& out);

 private:
  void Prepare(grpc::ClientContext* ctx) const;
  void PrintFiles(const google::protobuf::RepeatedPtrField<v1::CheckpointFile>& files,
                  std::ostream& out) const;
  absl::Status FromRpc(const char* call, const grpc::Status& s) const;
  absl::Status CheckSocket() const;
  // The per-uid table of `stats`: each uid's use of each bounded resource.
  static void PrintUidUsage(const v1::GetStatsResponse& resp, std::ostream& out);

  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Dos::Stub> dos_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

}  // namespace dos::dosctl
