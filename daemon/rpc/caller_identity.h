// CallerIdentity: who is calling, as the kernel says, for every gRPC call.
//
// gRPC does not expose a unix socket's peer credentials, so dosd accepts the
// connections on its unix socket itself (UnixListener), reads SO_PEERCRED and
// SO_PEERGROUPS of each, and hands the descriptor to gRPC
// (AddInsecureChannelFromFd), which names such a connection's peer "fd:<n>".
// A handler maps its ServerContext's peer back to the credentials recorded
// for that descriptor (checked against the socket's inode, so a reused
// descriptor number never inherits another connection's identity; gRPC keeps
// a connection's descriptor open while any call on it runs). Calls over the
// TCP listener carry no identity (`known` is false).
//
// Authorization (Authorizer): with --allow_uids / --allow_gids only those
// uids, primary or supplementary gids may attach, judged on the attaching
// process's kernel credentials (its descriptor socket Hello).
// A session belongs to the uid that attached it.
// Acting on a session needs that uid or an operator: root, dosd's own uid, or
// a member of --operator_gids. Calls without identity (TCP) may only read
// (GetStats, ListSessions, GetPolicy) unless --tcp_operator_calls.
//
// Thread-safety: PeerTable and Authorizer are thread-safe.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace dos {

struct CallerIdentity {
  bool known = false;   // false: no kernel credentials (TCP, or an unknown peer)
  pid_t pid = 0;        // in dosd's pid namespace
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary, at connect time
  std::string peer;     // gRPC's peer string, for messages
};

// Descriptor -> credentials of the connections UnixListener handed to gRPC.
class PeerTable {
 public:
  void Record(int fd, ino_t inode, CallerIdentity id);
  // The identity of gRPC peer `peer` ("fd:<n>"); unknown for anything else
  // or a descriptor that no longer is the recorded socket.
  CallerIdentity Lookup(absl::string_view peer) const;
  // Connections of `uid` still open (entries whose descriptor is still the
  // recorded socket); forgets the closed ones.
  size_t Connections(uid_t uid);

 private:
  struct Entry {
    ino_t inode;
    CallerIdentity id;
  };
  mutable absl::Mutex mu_;
  std::map<int, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

struct AuthorizerOptions {
  std::vector<gid_t> operator_gids;  // members act on every session
  bool tcp_operator_calls = false;   // TCP callers count as operators
  uid_t daemon_uid = 0;              // dosd's own uid (an operator)
  std::vector<uid_t> allow_uids;     // may attach; with allow_gids empty too: anyone
  std::vector<gid_t> allow_gids;     // primary or supplementary group that may attach
};

// Parses "dos-admin,1005" (group names or gids) into gids; false on an
// unknown name or a bad number.
bool ParseGroupList(absl::string_view text, std::vector<gid_t>* out);
// Parses "1000,1001" into ids; false on a bad entry.
bool ParseIdList(absl::string_view text, std::vector<uint32_t>* out);

class Authorizer {
 public:
  explicit Authorizer(AuthorizerOptions options) : options_(std::move(options)) {}

  bool IsOperator(const CallerIdentity& c) const;
  // OK if `c` may act on a session owned by `owner` (`what` names the call
  // for the message); PERMISSION_DENIED naming both uids and the fix.
  absl::Status MayActOn(const CallerIdentity& c, uid_t owner, uint64_t session_id,
                        absl::string_view what) const;
  // OK for operators only (calls on every session, the default policy).
  absl::Status MustBeOperator(const CallerIdentity& c, absl::string_view what) const;
  // OK if a process of (uid, gid, supplementary groups) may attach under the
  // allow lists (always, without lists); PERMISSION_DENIED naming the lists.
  absl::Status MayAttach(uid_t uid, gid_t gid, const std::vector<gid_t>& groups) const;
  // OK for callers with kernel credentials (Attach, resume).
  absl::Status MustBeLocal(const CallerIdentity& c, absl::string_view what) const;

 private:
  const AuthorizerOptions options_;
};

}  // namespace dos
