// PeerAuth: kernel-checked identity of attaching trainers. gRPC does not
// expose SO_PEERCRED, so the daemon serves a second unix socket,
// "<socket>.auth", beside the gRPC one. A client connects to it; the daemon
// reads the peer's (pid, uid, gid) from the kernel (SO_PEERCRED), checks uid,
// primary gid and supplementary groups (/proc/<pid>/status) against the allow
// lists and answers one line, "OK <ticket>" or "DENIED <why>", then closes.
// The ticket is random, single-use, valid for 30 s and bound to that pid:
// Attach must carry it (AttachRequest.peer_ticket) and claim the same pid, so
// a process can attach only as itself and only if its credentials are
// allowed. Anything that cannot connect to the sockets (file mode 0660 and
// --group) is refused by the kernel before that.
//
// Enabled when an allow list is given; otherwise Check() accepts any Attach.
//
// Thread-safety: thread-safe; one thread ("dos-auth") serves the socket.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dos {

struct PeerAuthOptions {
  std::vector<uid_t> allow_uids;  // empty with empty allow_gids: no check
  std::vector<gid_t> allow_gids;  // primary or supplementary group
  mode_t socket_mode = 0660;
  gid_t group = static_cast<gid_t>(-1);
};

class PeerAuth {
 public:
  // Listens on `auth_socket` when an allow list is set (else serves nothing).
  static absl::StatusOr<std::unique_ptr<PeerAuth>> Start(const std::string& auth_socket,
                                                         PeerAuthOptions options);
  ~PeerAuth();  // Stops the thread, removes the socket.

  bool enabled() const { return listen_fd_ >= 0; }
  // For Attach: OK when disabled; else `ticket` must be a live ticket issued
  // to `pid` (consumed). PERMISSION_DENIED otherwise, saying what to do.
  absl::Status Check(absl::string_view ticket, int32_t pid);

  // Whether (uid, gid, supplementary groups) pass the allow lists.
  static bool Allowed(const PeerAuthOptions& o, uid_t uid, gid_t gid,
                      const std::vector<gid_t>& groups);

 private:
  PeerAuth(std::string path, PeerAuthOptions options, int listen_fd, int wake_fd);
  void Loop();
  void Serve(int fd);

  const std::string path_;
  const PeerAuthOptions options_;
  const int listen_fd_;
  const int wake_fd_;
  std::thread thread_;

  struct Ticket {
    int32_t pid;
    absl::Time expires;
  };
  absl::Mutex mu_;
  std::map<std::string, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
};

// Parses "1000,1001" into ids; false on a bad entry.
bool ParseIdList(absl::string_view text, std::vector<uint32_t>* out);

}  // namespace dos
