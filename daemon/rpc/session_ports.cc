#include "daemon/rpc/session_ports.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dos {

absl::StatusOr<std::unique_ptr<DescriptorServer>> StartDescriptorSocket(const std::string& path,
                                                                        mode_t mode, gid_t group,
                                                                        SessionManager* sessions,
                                                                        UidLedger* ledger,
                                                                        uint32_t fd_reserve) {
  DescriptorServer::Options options;
  options.ledger = ledger;
  options.socket_mode = mode;
  options.group = group;
  options.reserve = std::make_shared<FdReserve>(FdReserve::AtStart(fd_reserve));
  options.sessions_of = [sessions](uint32_t uid) { return sessions->SessionsOf(uid); };
  return DescriptorServer::Start(
      path, options,
      [sessions](uint64_t id, absl::string_view token,
                 const PeerProcess& caller) -> absl::StatusOr<SessionPort> {
        absl::StatusOr<std::shared_ptr<Session>> s = sessions->Find(id, token);
        if (!s.ok()) return s.status();
        if ((*s)->identity().process != nullptr && (*s)->identity().uid != caller.uid()) {
          return absl::PermissionDeniedError(absl::StrCat(
              "session ", id, " belongs to uid ", (*s)->identity().uid, ", not to uid ",
              caller.uid(), "; only the attaching user may pass memory to or from it"));
        }
        // The callbacks use the session while the port holds it (keep_alive).
        Session* session = s->get();
        SessionPort port;
        port.control_fd = session->control_fd();
        port.control_block = [session] { return session->ControlBlockFd(); };
        port.inbox = session->inbox();
        port.hold_connection = [session](UniqueFd c) {
          session->HoldClientConnection(std::move(c));
        };
        port.state_memory = [s = session]() -> absl::StatusOr<std::vector<UniqueFd>> {
          absl::StatusOr<ShardState::StateMemory> m = s->ExportStateMemory();
          if (!m.ok()) return m.status();
          std::vector<UniqueFd> fds;
          fds.push_back(std::move(m->state));
          fds.push_back(std::move(m->map));
          return fds;
        };
        port.account = session->account();
        port.keep_alive = sessions->HoldForPort(*std::move(s));
        return port;
      });
}

}  // namespace dos
