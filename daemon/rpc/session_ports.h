// StartDescriptorSocket: dosd's descriptor socket (daemon/transport/
// fd_server.h) wired to the session table. A control block or segment
// request reaches a session only with its id and token and only from the uid
// that attached it (the kernel's word, SO_PEERCRED).
//
// Thread-safety: the server's thread calls into the thread-safe SessionManager.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/session/session_manager.h"
#include "daemon/transport/fd_server.h"

namespace dos {

// Listens on `path` (mode and group as the gRPC socket); `sessions` and
// `ledger` (connections per uid; may be null) outlive the server. It first
// raises dosd's soft RLIMIT_NOFILE to the hard limit (FdReserve::AtStart,
// logged: every session costs descriptors, and this is where they are asked
// for) and keeps `fd_reserve` descriptors below it for uids that hold no
// session (daemon/common/fd_limits.h; 0: none).
absl::StatusOr<std::unique_ptr<DescriptorServer>> StartDescriptorSocket(const std::string& path,
                                                                        mode_t mode, gid_t group,
                                                                        SessionManager* sessions,
                                                                        UidLedger* ledger,
                                                                        uint32_t fd_reserve);

}  // namespace dos
