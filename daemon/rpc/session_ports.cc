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
        SessionPort port;
        port.control_fd = (*s)->control_fd();
        port.control_block = [s = *s] { return s->ControlBlockFd(); };
        port.inbox = (*s)->inbox();
        port.hold_connection = [s = *s](UniqueFd c) { s->HoldClientConnection(std::move(c)); };
        port.state_memory = [s = *s]() -> absl::StatusOr<std::vector<UniqueFd>> {
          absl::StatusOr<ShardState::StateMemory> m = s->ExportStateMemory();
          if (!m.ok()) return m.status();
          std::vector<UniqueFd> fds;
          fds.push_back(std::move(m->state));
          fds.push_back(std::move(m->map));
          return fds;
        };
        port.keep_alive = *s;
        port.account = (*s)->account();
        return port;
      });
}

}  // namespace dos
