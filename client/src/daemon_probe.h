// ProbeDaemon: what `python -m dos` and other diagnostics ask a dosd without
// attaching a session: is the socket there, does the daemon answer, is it
// SERVING, which release and protocol it runs. No state is created.
//
// Thread-safety: a free function; safe from any thread.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace dos::client {

struct DaemonInfo {
  int32_t pid = 0;
  std::string version;           // the daemon's release
  uint32_t protocol_version = 0; // 0: a daemon too old to say
  std::string health;            // "SERVING", "NOT_SERVING", ...
  uint32_t sessions = 0;
};

// What CheckDaemonSocket (dos/wire/socket_access.h) says when the socket is
// missing (UNAVAILABLE, how to start dosd) or refuses this process
// (PERMISSION_DENIED, the group to join and "log in again"); UNAVAILABLE
// when nothing answers on it; the daemon's own error otherwise. `timeout_ms` bounds each call.
absl::StatusOr<DaemonInfo> ProbeDaemon(const std::string& socket_path, int64_t timeout_ms);

// This library's release and protocol.
const char* ClientRelease();
uint32_t ClientProtocolVersion();

}  // namespace dos::client
