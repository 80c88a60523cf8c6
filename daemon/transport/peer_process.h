// PeerProcess: who is on the other end of a unix socket, from the kernel.
//
// FromSocket reads SO_PEERCRED (pid, uid, gid as of connect(), the pid in
// dosd's own pid namespace, so a trainer in a container is identified by
// the kernel, not by a pid it claims), SO_PEERGROUPS (its supplementary
// groups, for --allow_gids) and holds a pidfd of that process
// (SO_PEERPIDFD where the kernel has it, else pidfd_open). Alive() polls the
// pidfd: it turns false once the process exits (zombies included), and pid
// reuse cannot fool it.
//
// Thread-safety: immutable after creation; Alive() is thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "dos/wire/unique_fd.h"

namespace dos {

class PeerProcess {
 public:
  static absl::StatusOr<std::shared_ptr<const PeerProcess>> FromSocket(int sock);
  // For tests and callers that start the process themselves.
  static absl::StatusOr<std::shared_ptr<const PeerProcess>> FromPid(pid_t pid);

  pid_t pid() const { return pid_; }
  uid_t uid() const { return uid_; }
  gid_t gid() const { return gid_; }
  const std::vector<gid_t>& groups() const { return groups_; }  // supplementary
  bool Alive() const;

 private:
  PeerProcess(pid_t pid, uid_t uid, gid_t gid, std::vector<gid_t> groups, UniqueFd pidfd)
      : pid_(pid), uid_(uid), gid_(gid), groups_(std::move(groups)), pidfd_(std::move(pidfd)) {}

  const pid_t pid_;
  const uid_t uid_;
  const gid_t gid_;
  const std::vector<gid_t> groups_;
  const UniqueFd pidfd_;
};

}  // namespace dos
