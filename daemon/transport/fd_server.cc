#include "daemon/transport/fd_server.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"

namespace dos {
namespace {

std::string NewTicket() {
  std::random_device rd;  // /dev/urandom
  std::string t;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&t, absl::StrFormat("%08x", rd()));
  return t;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DescriptorServer>> DescriptorServer::Start(const std::string& path,
                                                                           Options options,
                                                                           ResolveFn resolve) {
  ::unlink(path.c_str());  // a crashed dosd's; ours: the gRPC socket's lock is already held
  SocketListenerOptions o;
  o.type = SOCK_SEQPACKET;
  o.mode = options.socket_mode;
  o.group = options.group;
  o.backlog = 128;
  o.thread_name = "dos-fd";
  o.flag = "--socket (the descriptor socket is <socket>.fd)";
  absl::StatusOr<std::unique_ptr<SocketListener>> listener = SocketListener::Bind(path, std::move(o));
  if (!listener.ok()) return listener.status();
  std::unique_ptr<DescriptorServer> s(
      new DescriptorServer(path, std::move(options), std::move(resolve)));
  s->listener_ = *std::move(listener);
  if (absl::Status st = s->listener_->Serve([raw = s.get()](UniqueFd c) { raw->Serve(std::move(c)); });
      !st.ok()) {
    return st;
  }
  return s;
}

std::unique_ptr<DescriptorServer> DescriptorServer::ForTesting(Options options,
                                                               ResolveFn resolve) {
  return std::unique_ptr<DescriptorServer>(
      new DescriptorServer("", std::move(options), std::move(resolve)));
}

void DescriptorServer::Serve(UniqueFd conn) {
  const int fd = conn.get();
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  absl::StatusOr<std::shared_ptr<const PeerProcess>> caller = PeerProcess::FromSocket(fd);
  if (!caller.ok()) {
    fdproto::Reply r = fdproto::MakeReply(caller.status());
    fdproto::SendMessage(fd, &r, sizeof r, {}).IgnoreError();
    return;
  }
  alignas(fdproto::Request) char buf[sizeof(fdproto::Request) + 1];
  std::vector<UniqueFd> fds;
  absl::StatusOr<size_t> n = fdproto::ReceiveMessage(fd, buf, sizeof buf, &fds);
  if (!n.ok()) {
    DOS_LOG_WARNING("fd.bad_request", "pid", (*caller)->pid(), "uid", (*caller)->uid(), "error",
                    n.status().message());
    fdproto::Reply r = fdproto::MakeReply(n.status());
    fdproto::SendMessage(fd, &r, sizeof r, {}).IgnoreError();
    return;
  }
  // Short of descriptors: only uids that hold few sessions go on (the
  // request is read first: closing on an unread one resets the peer, which
  // would then not see why).
  if (options_.reserve != nullptr && options_.sessions_of) {
    const uint32_t uid = (*caller)->uid();
    if (absl::Status st = options_.reserve->Admit(fd, uid, options_.sessions_of(uid)); !st.ok()) {
      fdproto::Reply r = fdproto::MakeReply(st);
      fdproto::SendMessage(fd, &r, sizeof r, {}).IgnoreError();
      return;
    }
  }
  int send_fd = -1;
  SessionPort port;
  std::vector<UniqueFd> owned;
  fdproto::Reply reply = Handle(buf, *n, std::move(fds), *caller, &send_fd, &port, &owned);
  std::vector<int> out;
  if (send_fd >= 0) out.push_back(send_fd);
  for (const UniqueFd& o : owned) out.push_back(o.get());
  absl::Status sent = fdproto::SendMessage(fd, &reply, sizeof reply, out);
  if (sent.ok() && send_fd >= 0 && port.hold_connection) port.hold_connection(std::move(conn));
}

absl::StatusOr<std::string> DescriptorServer::IssueTicket(
    std::shared_ptr<const PeerProcess> caller) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  size_t of_uid = 0;
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    if (it->second.expires < now) {
      it = tickets_.erase(it);
      continue;
    }
    if (it->second.process->uid() == caller->uid()) ++of_uid;
    ++it;
  }
  if (tickets_.size() >= options_.max_tickets || of_uid >= options_.max_tickets_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many attaches in progress (", of_uid, " of uid ", caller->uid(), ", ",
        tickets_.size(), " in all); attach after the pending ones finish (tickets expire in ",
        absl::FormatDuration(options_.ticket_life), ")"));
  }
  std::string ticket = NewTicket();
  tickets_[ticket] = Ticket{std::move(caller), now + options_.ticket_life};
  return ticket;
}

absl::StatusOr<std::shared_ptr<const PeerProcess>> DescriptorServer::Redeem(
    absl::string_view ticket) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(std::string(ticket));
  if (ticket.empty() || it == tickets_.end() || it->second.expires < absl::Now()) {
    if (it != tickets_.end()) tickets_.erase(it);
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: fd_ticket is missing, unknown or expired; connect to dosd's descriptor socket ",
        path_.empty() ? "<socket>.fd" : path_,
        " first and pass the ticket it answers (libdos_client does this)"));
  }
  std::shared_ptr<const PeerProcess> p = std::move(it->second.process);
  tickets_.erase(it);
  return p;
}

fdproto::Reply DescriptorServer::Handle(const void* data, size_t n, std::vector<UniqueFd> fds,
                                        const std::shared_ptr<const PeerProcess>& caller,
                                        int* send_fd, SessionPort* port_out,
                                        std::vector<UniqueFd>* owned) {
  *send_fd = -1;
  absl::StatusOr<fdproto::Request> req = fdproto::ParseRequest(data, n, fds.size());
  if (!req.ok()) return fdproto::MakeReply(req.status());
  const auto op = static_cast<fdproto::Op>(req->op);
  if (op == fdproto::Op::kHello) {
    absl::StatusOr<std::string> ticket = IssueTicket(caller);
    if (!ticket.ok()) return fdproto::MakeReply(ticket.status());
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    std::memcpy(r.text, ticket->data(), std::min(ticket->size(), sizeof(r.text) - 1));
    return r;
  }
  const std::string token = fdproto::RequestToken(*req);
  absl::StatusOr<SessionPort> port = resolve_(req->session_id, token, *caller);
  if (!port.ok()) {
    DOS_LOG_WARNING("fd.refused", "session", req->session_id, "pid", caller->pid(), "uid",
                    caller->uid(), "error", port.status().message());
    return fdproto::MakeReply(port.status());
  }
  if (op == fdproto::Op::kControlBlock) {
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    r.num_fds = 1;
    *send_fd = port->control_fd;
    if (port_out != nullptr) *port_out = *port;
    return r;
  }
  if (op == fdproto::Op::kStateMemory) {
    if (!port->state_memory || owned == nullptr) {
      return fdproto::MakeReply(absl::UnimplementedError("state memory: not served here"));
    }
    absl::StatusOr<std::vector<UniqueFd>> mem = port->state_memory();
    if (!mem.ok()) return fdproto::MakeReply(mem.status());
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    r.num_fds = static_cast<uint32_t>(mem->size());
    *owned = *std::move(mem);
    return r;
  }
  std::vector<std::unique_ptr<ShmSegment>> segments;
  for (size_t i = 0; i < fds.size(); ++i) {
    absl::StatusOr<std::unique_ptr<ShmSegment>> seg = ShmSegment::Adopt(
        std::move(fds[i]), absl::StrCat("session ", req->session_id, " segment ", i));
    if (!seg.ok()) {
      DOS_LOG_WARNING("fd.segment_refused", "session", req->session_id, "pid", caller->pid(),
                      "error", seg.status().message());
      return fdproto::MakeReply(seg.status());
    }
    segments.push_back(*std::move(seg));
  }
  absl::StatusOr<std::vector<uint64_t>> ids = port->inbox->AddAll(std::move(segments));
  if (!ids.ok()) return fdproto::MakeReply(ids.status());
  fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
  r.count = static_cast<uint32_t>(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) r.segment_ids[i] = (*ids)[i];
  return r;
}

}  // namespace dos
